"""A time limit on the user code the vLLM checks run: the connector and predicate modules a
config names are imported, and their classes asked, by ``explain`` and ``vllm-args`` (and
``validate --check-vllm``, and the engine's own check at start). A module that waits
forever on import would otherwise hang them without a word.

The limit is ``SIGALRM``'s timer, whose handler raises :class:`UserCodeTimeout` in the main
thread: that interrupts a sleep, a blocking read, a lock wait or a pure-Python loop, so the
check ends in a ``ConfigError`` at the leaf. The exception is a ``BaseException`` (like
``KeyboardInterrupt``) so that an ``except Exception`` in the user's code cannot swallow it.
The timer is set only in the main thread and only while nobody else handles ``SIGALRM``
(the previous handler is put back): other code's use of the signal is never disturbed, and
there is then no limit. Code that never returns to the interpreter (a C extension spinning,
or blocked without a timeout) cannot be interrupted; a watchdog thread then ends the
process with a one-line message and status 1, :data:`GRACE_S` after the limit.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator

#: Seconds a leaf's checks (or a route's predicates) may take. vLLM is imported before; a
#: connector module that imports a large package of its own (LMCache, NIXL) may take tens of
#: seconds on a busy machine.
DEFAULT_S = 120.0
ENV = "KVCOMPOSE_CHECK_TIMEOUT"
#: Seconds the watchdog waits after the limit before it ends the process.
GRACE_S = 5.0


class UserCodeTimeout(BaseException):
    """The user's code ran past the limit of ``seconds`` (raised inside it by the timer)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


def limit_s() -> float:
    """The limit in seconds, from ``KVCOMPOSE_CHECK_TIMEOUT`` (0 turns it off); raises
    ``ValueError`` with a message for a value that is not a number of seconds."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{ENV}={text[:40]!r}: must be a number of seconds (0: no limit)")
    return value


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`UserCodeTimeout` in the body after ``seconds`` (0: no limit); ``what``
    names the code for the watchdog's message."""
    if (
        seconds <= 0
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
    ):
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise UserCodeTimeout(seconds)

    done = threading.Event()
    watchdog = threading.Thread(
        target=_watch, args=(done, seconds + GRACE_S, what), name="kvcompose-check-watchdog"
    )
    watchdog.daemon = True
    signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    watchdog.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        done.set()


def _watch(done: threading.Event, after_s: float, what: str) -> None:
    if done.wait(after_s):
        return
    sys.stderr.write(
        f"kvcompose: {what} did not return within {after_s:.0f} s and cannot be interrupted "
        f"(set {ENV} to allow longer)\n"
    )
    sys.stderr.flush()
    os._exit(1)
