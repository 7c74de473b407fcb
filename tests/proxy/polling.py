"""Waiting in proxy tests for what the proxy does after it has answered (a hand-off released,
a backend aborted): the condition, polled every 20 ms until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
