"""Recording and fault injection inside an engine process (run through
``EngineProcess.call``; ``kvcompose.testing.pd`` re-exports them): ``trace_on``/``take_trace``
record scheduler steps, block frees and every connector's lookups, allocations and finishes;
``drop_calls`` makes a connector stop receiving a method. Times are ``time.monotonic()``."""

from __future__ import annotations

import time
from typing import Any

from kvcompose.engine import probe
from kvcompose.engine.probe import walk_connectors


def scheduler_connectors(llm: Any) -> dict[str, Any]:
    """The scheduler-side connector tree, by path (``"root"``, ``"nixl"``, ``"a/b"``)."""
    return {n.path: n.connector for n in walk_connectors(probe.scheduler_connector(llm))}


_TRACE: dict[str, Any] = {}


def trace_on(llm: Any) -> None:
    """Record, with ``time.monotonic()`` stamps: every scheduler step, and the tokens each
    step scheduled per request (``scheduled``: what the engine computed, so a load that
    failed shows as recomputed tokens); every block free of a request (``free``: request id,
    blocks); and for every connector of the scheduler-side tree, each ``lookup`` (what it
    answered), ``alloc`` (the tokens it was told) and ``finished`` (whether it delays the
    free). Idempotent; ``take_trace`` reads it."""
    if "trace" in _TRACE:
        return
    trace: dict[str, Any] = {"steps": 0, "step_times": [], "events": [], "scheduled": {}}
    _TRACE["trace"] = trace
    sched = probe.scheduler(llm)
    events = trace["events"]

    orig_schedule = sched.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        trace["steps"] += 1
        times = trace["step_times"]
        times.append(time.monotonic())
        if len(times) > 20000:
            del times[:10000]
        out = orig_schedule(*a, **kw)
        scheduled = trace["scheduled"]
        for req_id, n in out.num_scheduled_tokens.items():
            scheduled[req_id] = scheduled.get(req_id, 0) + n
        return out

    sched.schedule = schedule

    orig_free = sched._free_blocks

    def free_blocks(request: Any) -> Any:
        try:
            n = sum(len(g) for g in sched.kv_cache_manager.get_block_ids(request.request_id))
        except Exception:
            n = None
        events.append(
            {
                "kind": "free",
                "t": time.monotonic(),
                "req": request.request_id,
                "blocks": n,
                "step": trace["steps"],
            }
        )
        return orig_free(request)

    sched._free_blocks = free_blocks

    for path, conn in scheduler_connectors(llm).items():
        _wrap_connector(conn, path, trace)
        _rebind(llm, conn)


def _rebind(llm: Any, conn: Any) -> None:
    """Let kvcompose nodes above ``conn`` re-cache its (now wrapped) hot-path methods."""
    for _, parent in scheduler_connectors(llm).items():
        if conn in (getattr(parent, "_connectors", None) or ()):
            parent.refresh_child_methods()


def _wrap_connector(conn: Any, path: str, trace: dict[str, Any]) -> None:
    events = trace["events"]
    lookup, alloc, finish = (
        conn.get_num_new_matched_tokens,
        conn.update_state_after_alloc,
        conn.request_finished,
    )

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
        result = lookup(request, num_computed_tokens)
        events.append(
            {
                "kind": "lookup",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "local": num_computed_tokens,
                "result": tuple(result),
                "step": trace["steps"],
            }
        )
        return result

    def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        events.append(
            {
                "kind": "alloc",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "tokens": num_external_tokens,
                "step": trace["steps"],
            }
        )
        return alloc(request, blocks, num_external_tokens)

    def request_finished(request: Any, block_ids: Any) -> Any:
        result = finish(request, block_ids)
        events.append(
            {
                "kind": "finished",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "delay": bool(result[0]),
                "status": request.status.name,
                "step": trace["steps"],
            }
        )
        return result

    conn.get_num_new_matched_tokens = get_num_new_matched_tokens
    conn.update_state_after_alloc = update_state_after_alloc
    conn.request_finished = request_finished


def take_trace(llm: Any, clear: bool = True) -> dict[str, Any]:
    """The recorded events, step times and scheduled tokens per request since ``trace_on``
    or the last ``take_trace``."""
    trace = _TRACE.get("trace")
    if trace is None:
        return {"steps": None, "step_times": [], "events": [], "scheduled": {}}
    out = {
        "steps": trace["steps"],
        "step_times": list(trace["step_times"]),
        "events": list(trace["events"]),
        "scheduled": dict(trace["scheduled"]),
    }
    if clear:
        trace["events"].clear()
        trace["step_times"].clear()
        trace["scheduled"].clear()
    return out


_DROPPED: dict[tuple[str, str], Any] = {}


def drop_calls(
    llm: Any, node: str, method: str, *, zero_only: bool = False, enable: bool = True
) -> None:
    """Fault injection: the scheduler-side connector at ``node`` (a path of
    ``scheduler_connectors``) stops receiving ``method`` calls, as if its parent stopped
    talking to it. ``zero_only`` (for ``update_state_after_alloc``) drops only the calls
    with 0 external tokens: the upstream bug where a composite does not tell a child that
    another child owns the load. Dropped calls are recorded as ``dropped`` trace events.
    ``enable=False`` restores the method."""
    conn = scheduler_connectors(llm)[node]
    key = (node, method)
    if not enable:
        if key in _DROPPED:
            setattr(conn, method, _DROPPED.pop(key))
            _rebind(llm, conn)
        return
    if key in _DROPPED:
        return
    original = getattr(conn, method)
    _DROPPED[key] = original
    trace = _TRACE.get("trace")

    def dropped(*args: Any, **kwargs: Any) -> Any:
        if zero_only and not (len(args) >= 3 and args[2] == 0):
            return original(*args, **kwargs)
        if trace is not None:
            request = args[0] if args else None
            trace["events"].append(
                {
                    "kind": "dropped",
                    "t": time.monotonic(),
                    "node": node,
                    "method": method,
                    "req": getattr(request, "request_id", None),
                    "step": trace["steps"],
                }
            )
        if method == "request_finished":
            return False, None
        return None

    setattr(conn, method, dropped)
    _rebind(llm, conn)
