"""Fixtures for composite tests on vLLM's real scheduler with scripted children."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

BLOCK = 16


@pytest.fixture
def harness(harness_factory: Callable[..., Any]) -> Callable[..., Any]:
    """``harness(kv_transfer_config, **kw)`` → a SchedulerHarness with a worker connector."""

    def make(config: dict[str, Any], **kw: Any) -> Any:
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("with_worker", True)
        return harness_factory(config, **kw)

    return make
