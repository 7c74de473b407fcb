"""The backend engines and how one is chosen: least outstanding requests among the healthy.

A backend is taken out when a request to it fails at the transport level (refused, reset,
timed out, 5xx) or a health check fails, and put back when a health check passes. Selection
prefers backends the request has not failed on yet, but a request is never refused only for
that: a decode engine that reported one load failure is usually fine for the next attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode"]
#: a health check's answer: ``slow`` is a timeout (busy or dying), ``down`` a refusal or an
#: error status; a check function may also answer ``True``/``False`` (``ok``/``down``)
Health = Literal["ok", "slow", "down"]

log = logging.getLogger("kvcompose.proxy")


@dataclass
class Backend:
    url: str
    role: Role
    healthy: bool = True
    outstanding: int = 0
    failures: int = 0
    last_failure: float = 0.0
    last_error: str = ""
    served: int = 0
    slow_checks: int = 0  # health checks timed out in a row

    @contextlib.contextmanager
    def use(self) -> Iterator[Backend]:
        """Count a request as outstanding on this backend while the block runs."""
        self.outstanding += 1
        self.served += 1
        try:
            yield self
        finally:
            self.outstanding -= 1


@dataclass
class BackendPool:
    prefill: list[Backend] = field(default_factory=list)
    decode: list[Backend] = field(default_factory=list)
    on_change: Callable[[Backend], None] | None = None
    #: health checks timed out in a row that take a backend out (a refused check: one)
    slow_checks_out: int = 3

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str]) -> BackendPool:
        return cls([Backend(u, "prefill") for u in prefill], [Backend(u, "decode") for u in decode])

    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    def of(self, role: Role) -> list[Backend]:
        return self.prefill if role == "prefill" else self.decode

    def pick(self, role: Role, avoid: set[str] | frozenset[str] = frozenset()) -> Backend | None:
        """The healthy backend with the fewest outstanding requests, preferring those not in
        ``avoid`` (URLs). When none is healthy, the one that failed longest ago: a mark may
        be stale until the next health check, and a dead backend fails fast (refused)."""
        healthy = [b for b in self.of(role) if b.healthy]
        fresh = [b for b in healthy if b.url not in avoid] or healthy
        if fresh:
            return min(fresh, key=lambda b: (b.outstanding, b.served))
        backends = self.of(role)
        return min(backends, key=lambda b: b.last_failure) if backends else None

    def mark_failed(self, backend: Backend, error: str) -> None:
        backend.failures += 1
        backend.last_failure = time.monotonic()
        backend.last_error = error
        if backend.healthy:
            backend.healthy = False
            log.warning("%s backend %s taken out: %s", backend.role, backend.url, error)
            if self.on_change:
                self.on_change(backend)

    def mark_healthy(self, backend: Backend) -> None:
        if not backend.healthy:
            backend.healthy = True
            log.info("%s backend %s back in", backend.role, backend.url)
            if self.on_change:
                self.on_change(backend)


async def health_loop(
    pool: BackendPool, check: Callable[[Backend], Awaitable[Health | bool]], interval: float
) -> None:
    """Check every backend every ``interval`` seconds, forever (cancel to stop)."""
    while True:
        await check_all(pool, check)
        await asyncio.sleep(interval)


async def check_all(
    pool: BackendPool, check: Callable[[Backend], Awaitable[Health | bool]]
) -> None:
    """One health check of every backend. A refused or failed check takes a backend out at
    once; timeouts only when ``pool.slow_checks_out`` come in a row: an engine busy with a
    long prefill on a loaded machine answers ``/health`` late, and taking it out for that
    would send all traffic to the others (requests to a dead one fail fast anyway)."""
    backends = pool.all()
    results = await asyncio.gather(*(check(b) for b in backends), return_exceptions=True)
    for backend, result in zip(backends, results, strict=True):
        if result is True or result == "ok":
            backend.slow_checks = 0
            pool.mark_healthy(backend)
        elif result == "slow":
            backend.slow_checks += 1
            if backend.slow_checks >= pool.slow_checks_out:
                pool.mark_failed(backend, f"{backend.slow_checks} health checks timed out")
        else:
            backend.slow_checks = 0
            reason = (
                "health check failed" if result in (False, "down") else f"health check: {result!r}"
            )
            pool.mark_failed(backend, reason)
