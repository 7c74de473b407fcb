"""The lookup of a chain, fan-out or route node (scheduler side): ask the candidates, pick the
owner, record the decision in the ledger.

vLLM asks ``get_num_new_matched_tokens`` for every waiting request every step. The scheduler
half answers the common case itself (a request the node holds no record of, fixed
candidates, no child taken out of lookups, no debug trace; ``CompositeScheduler``); ``decide``
here is the whole rule: a request looked up again (pending, or after a failed load that
excluded its owner), the lookup deadline, route's per-request candidates, and the debug
decision record. Both apply the same checks: a child's well-formed answer is taken as is,
anything else goes through the guard (``kvcompose.composite.guard``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcompose.composite.ledger import LoadState

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.composite.children import Children
    from kvcompose.composite.guard import Guard
    from kvcompose.composite.ledger import Ledger, LoadRecord
    from kvcompose.composite.policies import Candidates, LookupPolicy
    from kvcompose.composite.stats import NodeCounters

logger = logging.getLogger("kvcompose")

#: A miss, as vLLM's contract spells it.
MISS = (0, False)


class LookupSide(Protocol):
    """What ``decide`` reads from its node's scheduler half
    (``kvcompose.composite.scheduler.CompositeScheduler``)."""

    name: str
    children: Children
    guard: Guard
    counters: NodeCounters
    ledger: Ledger
    debug: bool
    policy: LookupPolicy
    fixed_candidates: Candidates | None
    longest: bool
    stop_at_hit: bool
    lookup_timeout_s: float
    lookups: Sequence[Callable[[Request, int], Any]]


def well_formed(result: Any) -> bool:
    """``(n > 0, async)`` or ``(0, False)``: the answers taken without the guard (the scheduler
    half inlines the same test)."""
    if type(result) is not tuple or len(result) != 2:
        return False
    tokens, is_async = result
    return type(tokens) is int and (tokens > 0 or not is_async)


def deadline_and_exclusions(
    record: LoadRecord | None, timeout_s: float
) -> tuple[bool, frozenset[int]]:
    """Whether a pending request's lookup deadline has passed, and the children whose load
    of it failed (skipped)."""
    if record is None:
        return False, frozenset()
    timed_out = (
        record.state is LoadState.PENDING
        and record.pending_since is not None
        and time.monotonic() - record.pending_since >= timeout_s
    )
    return timed_out, record.excluded


def decide(
    sched: LookupSide, request: Request, num_computed_tokens: int, record: LoadRecord | None
) -> tuple[int | None, bool]:
    """The node's answer to vLLM for ``request`` (any state, any policy but stitch)."""
    req_id = request.request_id
    timed_out, excluded = deadline_and_exclusions(record, sched.lookup_timeout_s)
    candidates = sched.fixed_candidates or sched.policy.candidates(request)
    longest = sched.longest
    names = sched.children.names
    # what each child answered, kept only for the debug decision record
    trace: list[str] | None = [] if sched.debug else None
    best: tuple[int, int, bool] | None = None  # (child, tokens, async)
    pending = False
    timeouts: list[int] = []
    guard = sched.guard
    disabled = guard.disabled
    for child in candidates.children:
        if child in disabled:
            continue
        if child in excluded:
            if trace is not None:
                trace.append(f"{names[child]}=excluded(failed)")
            continue
        try:
            result = sched.lookups[child](request, num_computed_tokens)
        except Exception as exc:
            guard.child_error(child, "get_num_new_matched_tokens", exc)
            result = MISS
        if well_formed(result):
            tokens, is_async = result
        else:
            tokens, is_async = guard.normalise_lookup(child, result)
        if trace is not None:
            mark = "a" if is_async and tokens else ""
            trace.append(f"{names[child]}={tokens}{mark}")
        if tokens is None:
            if timed_out:
                timeouts.append(child)
                continue
            pending = True
            if longest:
                continue
            break
        if tokens > 0 and (best is None or (longest and tokens > best[1])):
            best = (child, tokens, is_async)
            if sched.stop_at_hit:
                break
    if pending:
        sched.ledger.mark_pending(req_id, time.monotonic())
        return None, False
    for child in timeouts:
        sched.counters.lookup_timeout(child)
    sched.counters.lookups += 1
    reason = candidates.reason
    if timeouts:
        reason += "+deadline"
    if excluded:
        reason += "+fallback"
    owner, tokens, is_async = best if best is not None else (None, 0, False)
    if owner is not None or record is not None:  # a plain miss needs no record
        sched.ledger.decide(req_id, owner, tokens, is_async, reason, num_computed_tokens)
    if owner is not None:
        sched.counters.hit(owner, tokens)
    if trace is not None:
        logger.debug(
            "kvcompose[%s] %s: asked [%s] → owner %s, %d tokens%s, by %s",
            sched.name,
            req_id,
            ", ".join(trace),
            "none" if owner is None else names[owner],
            tokens,
            " async" if is_async else "",
            reason,
        )
    return tokens, is_async
