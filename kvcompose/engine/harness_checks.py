"""What is left in a scheduler after a run: the harness's cleanliness check and description.

Kept apart from ``SchedulerHarness`` because it reads vLLM's scheduler containers by name,
and those names differ between vLLM versions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Scheduler containers that hold requests (names differ between vLLM versions; missing
# ones are skipped). ``finished_req_ids`` is flushed by the next schedule().
_QUEUE_ATTRS = (
    "waiting",
    "running",
    "kv_holding_waiting",
    "deferred_waiting",
    "skipped_waiting",
    "finished_recving_kv_req_ids",
    "failed_recving_kv_req_ids",
    "_inflight_prefills",
    "finished_req_ids",
)


def _ids(queue: Any) -> list[str]:
    return sorted(getattr(x, "request_id", str(x)) for x in queue)


def describe_scheduler(sched: Any, free: int, usable: int) -> str:
    """One line: the scheduler's requests, its non-empty queues and the free blocks."""
    parts = [f"requests={sorted(sched.requests)}"]
    for name in _QUEUE_ATTRS:
        q = getattr(sched, name, None)
        if q:
            parts.append(f"{name}={_ids(q)}")
    parts.append(f"free_blocks={free}/{usable}")
    return ", ".join(parts)


def leftovers(sched: Any, free: int, usable: int, connectors: Mapping[str, Any]) -> list[str]:
    """What a finished run left behind: requests in any scheduler queue, blocks not back in
    the pool, deferred frees, and per-request state of connectors that report it through
    ``live_requests()``. Empty when clean."""
    problems: list[str] = []
    if sched.requests:
        statuses = {r: req.status.name for r, req in sched.requests.items()}
        problems.append(f"scheduler.requests not empty: {statuses}")
    for name in _QUEUE_ATTRS:
        q = getattr(sched, name, None)
        if q:
            problems.append(f"scheduler.{name} not empty: {_ids(q)}")
    deferred_frees = getattr(sched, "deferred_frees", None)
    if deferred_frees:
        problems.append(f"scheduler.deferred_frees not empty ({len(deferred_frees)})")
    if free != usable:
        problems.append(
            f"{usable - free} KV blocks not returned to the pool ({free} free of {usable})"
        )
    for label, conn in connectors.items():
        live = getattr(conn, "live_requests", None)
        if callable(live):
            left = live()
            if left:
                problems.append(f"{label}.live_requests() not empty: {left!r}")
    return problems
