"""A stitched load's recovery from a failed segment, and the ranges it gives up.

vLLM reads a step's load failures before the connector sees the step's output, so the worker
half hides a parked stitched load's failed segment from vLLM and reports it in its metadata;
the scheduler half holds the round's receive back (the request stays parked) and here, at
the start of its next ``build_connector_meta``, plans the next round: another able child
(``native``, not excluded, not out of lookups) is looked up at the start ``s`` of each failed
range ``[s, e)`` and reloads it (or the part it holds, if it can be cut) into the request's
blocks; what no child reloads is given up with that round's receive: invalid blocks from the
first lost token on (vLLM keeps the prefix before it), or, on several KV cache groups,
``failed_recving`` (vLLM resets the request and looks it up again without the failed
children). A segment dropped because it straddled a smaller grant and cannot be cut is given
up the same way (``given_up``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvcompose.composite.ledger import LedgerError, LoadState
from kvcompose.composite.metadata import StitchLoad
from kvcompose.composite.segments import Segment, SegmentState, place

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.composite.children import Children
    from kvcompose.composite.guard import Guard
    from kvcompose.composite.ledger import Ledger, LoadRecord
    from kvcompose.composite.stats import NodeCounters
    from kvcompose.tree.ranges import RangeSupport


class RecoveryHost(Protocol):
    """What a recovery reads from its node's scheduler half
    (``kvcompose.composite.scheduler.CompositeScheduler``)."""

    children: Children
    guard: Guard
    counters: NodeCounters
    ledger: Ledger
    block_size: int
    block_level_failures: bool
    range_supports: tuple[RangeSupport, ...]
    allocs: Sequence[Callable[..., Any]]
    step_stitches: dict[str, StitchLoad]
    step_sync_segments: dict[str, tuple[tuple[int, tuple[int, ...]], ...]]
    step_invalid_blocks: list[int]

    def ask(self, child: int, request: Request, at: int) -> tuple[int | None, bool]: ...


def given_up(
    sched: RecoveryHost, record: LoadRecord, req_id: str, block_ids: list[int]
) -> tuple[int, ...]:
    """The blocks of the grant no segment loads (from ``lost_from`` on), reported invalid on
    a single KV cache group. On several groups a parked request goes up failed instead
    (``StitchLoad.failed``); a sync one has no way to say it, and is refused."""
    lost = record.lost_from
    if lost is None or not sched.block_level_failures:
        if lost is not None and record.state is not LoadState.LOADING:
            raise LedgerError(
                f"request {req_id}: vLLM's grant ends "
                f"inside an uncuttable segment of a sync stitched load on a model with "
                "several KV cache groups, where vLLM takes neither invalid blocks nor a "
                "failed receive; do not stitch such a child there"
            )
        return ()
    bs = sched.block_size
    return tuple(block_ids[lost // bs : -(-record.load_end // bs)])


def recover(sched: RecoveryHost, req_ids: list[str]) -> None:
    """Plan the next round of each stitched load whose round ended with a failed segment
    (``LoadState.RECOVERING``; its receive was held back). Called at the start of
    ``build_connector_meta``, so that the reloading children's loads go out in this step's
    metadata and no abort can come between a child's allocation and its metadata."""
    for req_id in req_ids:
        record = sched.ledger.get(req_id)
        if record is None or record.state is not LoadState.RECOVERING:
            # aborted since: vLLM holds the blocks until one receive comes
            sched.step_stitches[req_id] = StitchLoad((), {})
            continue
        reloads, lost = _plan_reloads(sched, record)
        sched.ledger.recovered(record, reloads, lost)
        ship_round(sched, record, req_id, reloads, list(record.blocks.get_block_ids()[0]))


def ship_round(
    sched: RecoveryHost,
    record: LoadRecord,
    req_id: str,
    segments: Sequence[Segment],
    block_ids: list[int],
) -> None:
    """Put one round of a stitched load (its first, or a recovery's) into this step's
    metadata: the sync segments, which the worker half checks this step, and while the load
    is in flight its ``StitchLoad`` (the children awaited, each segment's blocks and what is
    given up); a load already complete gives its lost blocks up as plain invalid blocks."""
    sync = tuple((s.child, s.block_ids) for s in segments if not s.is_async)
    if sync:
        sched.step_sync_segments[req_id] = sync
    lost = given_up(sched, record, req_id, block_ids)
    if record.state is LoadState.LOADING:
        sched.step_stitches[req_id] = StitchLoad(
            record.awaiting,
            {s.child: s.block_ids for s in segments},
            lost,
            record.lost_from is not None and not sched.block_level_failures,
        )
    else:
        sched.step_invalid_blocks.extend(lost)


def _plan_reloads(
    sched: RecoveryHost, record: LoadRecord
) -> tuple[tuple[Segment, ...], int | None]:
    """Reload segments for the record's failed ranges (told to their children), and where
    the load is given up (None: nowhere). A child reloads at most one range per round; on
    several KV cache groups every range is reloaded whole or none is (the request fails:
    vLLM takes no invalid blocks there)."""
    lost = record.lost_from
    block_level = sched.block_level_failures
    reloads: list[Segment] = []
    used: set[int] = set()
    for start, end in _failed_ranges(record.segments):
        if lost is not None and start >= lost:
            continue  # recomputed anyway
        found = _find_reload(sched, record, start, end, used)
        if found is None or (not block_level and found.end < end):
            lost = start if lost is None else min(lost, start)
            if not block_level:
                return (), lost
            continue
        reloads.append(found)
        used.add(found.child)
        if found.end < end:
            lost = found.end if lost is None else min(lost, found.end)
    if not block_level and lost is not None:
        return (), lost
    told: list[Segment] = []
    for r in reloads:  # in order: a refusal gives up everything after it
        if not _tell_reload(sched, record, r):
            lost = r.start if lost is None else min(lost, r.start)
            break
        told.append(r)
    return tuple(told), lost


def _failed_ranges(segments: Sequence[Segment]) -> list[tuple[int, int]]:
    """The failed segments' ranges in token order, adjacent ones joined: one child can then
    reload what two neighbours lost (it reloads one range a round)."""
    ranges: list[tuple[int, int]] = []
    for seg in sorted(
        (s for s in segments if s.state is SegmentState.FAILED), key=lambda s: s.start
    ):
        if ranges and ranges[-1][1] == seg.start:
            ranges[-1] = (ranges[-1][0], seg.end)
        else:
            ranges.append((seg.start, seg.end))
    return ranges


def _find_reload(
    sched: RecoveryHost, record: LoadRecord, start: int, end: int, used: set[int]
) -> Segment | None:
    """The first able child's reload of ``[start, end)`` (or of the part from ``start`` it
    holds, if it can be cut); None if no child can. Able: ``native``, not excluded (the
    failed children are), not out of lookups, not reloading another range this round, its
    alignment dividing ``start``."""
    request = record.request
    disabled = sched.guard.disabled
    block_size = sched.block_size
    for child, support in enumerate(sched.range_supports):
        if (
            support.mode != "native"
            or child in record.excluded
            or child in disabled
            or child in used
            or start % (support.align or block_size)
        ):
            continue
        tokens, is_async = sched.ask(child, request, start)
        if not tokens or tokens <= 0:
            continue
        take = min(tokens, end - start)
        if take < tokens and not support.can_cut:
            continue
        return Segment(
            child, start, start + take, is_async, support.mode, support.can_cut, reload=True
        )
    return None


def _tell_reload(sched: RecoveryHost, record: LoadRecord, reload: Segment) -> bool:
    """Hand ``reload`` to its child (its range, then the allocation with the request's
    blocks); False if the child raised (a miss)."""
    request, blocks = record.request, record.blocks
    child = reload.child
    place((reload,), list(blocks.get_block_ids()[0]), sched.block_size)
    try:
        set_range = getattr(sched.children.connectors[child], "set_load_range", None)
        if set_range is not None:
            set_range(request.request_id, reload.start, reload.end)
        sched.allocs[child](request, blocks, reload.tokens)
    except Exception as exc:
        sched.guard.child_error(child, "update_state_after_alloc", exc)
        return False
    reload.state = SegmentState.LOADING if reload.is_async else SegmentState.LOADED
    name = sched.children.names[child]
    sched.counters.inc(f"reloads.{name}")
    sched.counters.inc(f"reloaded_tokens.{name}", reload.tokens)
    return True
