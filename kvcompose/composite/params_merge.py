"""How a node merges its children's ``kv_transfer_params`` at ``request_finished``: every
child's keys go up in one dict; where two children set one key to different values the first
child's value is kept and the clash is a contract violation of the later one (a P/D hand-off
must not carry two answers for, say, the remote blocks)."""

from __future__ import annotations

from typing import Any

from kvcompose.composite.guard import Guard


def merge_params(
    merged: dict[str, Any] | None,
    params: dict[str, Any],
    producer: dict[str, int],
    child: int,
    req_id: str,
    guard: Guard,
) -> dict[str, Any]:
    """``merged`` with ``child``'s ``params`` added; ``producer`` records which child set
    each key (updated in place)."""
    merged = {} if merged is None else merged
    for key, value in params.items():
        if key in producer and merged[key] != value:
            other = guard.child_names[producer[key]]
            guard.violation(
                child,
                "params_clash",
                f"kv_transfer_params key {key!r} for {req_id} also set "
                f"by {other!r}; keeping {other!r}'s value",
            )
            continue
        producer.setdefault(key, child)
        merged.setdefault(key, value)
    return merged
