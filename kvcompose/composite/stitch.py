"""Stitched loads, scheduler side: several children load one request, each its own range
(``chain`` with ``policy: stitch``). ``StitchPlanner`` owns their bookkeeping from allocation
to the last recovery round; the lookup that makes the segments is the one rule of
``kvcompose.composite.lookup``.

**Allocation.** vLLM is told the segments' total and whether any is async (never
``(0, True)``). At allocation every segment's child hears its own count (a ``last_segment``
child through a block view starting at its segment; a child with ``set_load_range``,
kvcompose's store, is also told its range explicitly), every other child 0; a grant smaller
than the total re-cuts the segments (``kvcompose.composite.segments``).

**Grants smaller than promised.** vLLM 0.32/0.33 grant 0 (request-level prefix-cache skip, a
local hit with a sub-block tail at least as long as the hit, a total hit within a bounded
replay window) or, on models with bounded prefix replay (DeepSeek-V4.1's sliding-window MLA),
the promise rounded down to a block. A segment straddling the cut is cut if its child can be
cut short; otherwise it is dropped (its child hears 0) and the grant's part from its start is
given up: its blocks are reported invalid (vLLM keeps the prefix before them and recomputes the
rest), or, on several KV cache groups (vLLM refuses invalid blocks there), the parked request
goes up in ``failed_recving`` and is looked up again without that child.

**Recovery from a failed segment.** vLLM reads a step's load failures before the connector
sees the step's output, so the worker half hides a parked stitched load's failed segment from
vLLM and reports it in its metadata; the scheduler half holds the round's receive back (the
request stays parked) and ``recover``, at the start of its next ``build_connector_meta``,
plans the next round: another able child (``native``, not excluded, not out of lookups) is
looked up at the start ``s`` of each failed range ``[s, e)`` and reloads it (or the part it
holds, if it can be cut) into the request's blocks; what no child reloads is given up with
that round's receive: invalid blocks from the first lost token on (vLLM keeps the prefix
before it), or, on several KV cache groups, ``failed_recving`` (vLLM resets the request and
looks it up again without the failed children). vLLM sees one receive, after the last round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose.composite.ledger import LedgerError, LoadState
from kvcompose.composite.metadata import StitchLoad
from kvcompose.composite.segments import Segment, SegmentState, block_view, place

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from kvcompose.composite.ledger import LoadRecord
    from kvcompose.composite.lookup import Lookup

SyncSegments = tuple[tuple[int, tuple[int, ...]], ...]


class StitchPlanner:
    """The stitched loads of one node's scheduler half, and what one step ships of them to
    the worker half (``take_step``)."""

    def __init__(
        self,
        lookup: Lookup,
        base_hit_sources: Callable[[Request, int], dict[Any, int]],
        *,
        block_level_failures: bool,
    ) -> None:
        self._lookup = lookup
        self.children = lookup.children
        self.guard = lookup.guard
        self.counters = lookup.counters
        self.ledger = lookup.ledger
        self.block_size = lookup.block_size
        self._base_hit_sources = base_hit_sources
        # vLLM refuses invalid block ids on models with several KV cache groups
        self.block_level_failures = block_level_failures
        #: the children's ``update_state_after_alloc``, cached by the scheduler half
        self.allocs: Sequence[Callable[..., Any]] = ()
        self._stitches: dict[str, StitchLoad] = {}
        self._sync_segments: dict[str, SyncSegments] = {}
        self._invalid_blocks: list[int] = []

    def take_step(self) -> tuple[dict[str, StitchLoad], dict[str, SyncSegments], tuple[int, ...]]:
        """This step's rounds in flight, sync segments and given-up blocks, for the metadata."""
        step = self._stitches, self._sync_segments, tuple(self._invalid_blocks)
        self._stitches, self._sync_segments, self._invalid_blocks = {}, {}, []
        return step

    # ---------------------------------------------------------------- allocation
    def allocated(
        self, record: LoadRecord, request: Request, blocks: KVCacheBlocks, n: int
    ) -> None:
        if n > 0 and record.state in (LoadState.LOADING, LoadState.LOADED):
            block_ids = list(blocks.get_block_ids()[0])
            place(record.segments, block_ids, self.block_size)
            self._tell_children(record, request, blocks)
            active = [s for s in record.segments if s.active]
            if record.state is LoadState.LOADING:
                record.request, record.blocks = request, blocks  # for a recovery
                record.awaiting = tuple(s.child for s in active if s.is_async)
            self._ship_round(record, request.request_id, active, block_ids)
            return
        for i, alloc in enumerate(self.allocs):  # a 0 grant, or the second pass
            try:
                alloc(request, blocks, 0)
            except Exception as exc:
                self.guard.child_error(i, "update_state_after_alloc", exc)

    def _tell_children(self, record: LoadRecord, request: Request, blocks: KVCacheBlocks) -> None:
        """Tell every child its part of a stitched load (the record's segments, already cut to
        the grant): each segment's child its count, every other child 0."""
        counts = {s.child: s for s in record.segments if s.active}
        for i, alloc in enumerate(self.allocs):
            segment = counts.get(i)
            if segment is None:
                try:
                    alloc(request, blocks, 0)
                except Exception as exc:
                    self.guard.child_error(i, "update_state_after_alloc", exc)
                continue
            set_range = getattr(self.children.connectors[i], "set_load_range", None)
            if set_range is not None:  # a child that takes its range explicitly
                set_range(request.request_id, segment.start, segment.end)
            shown = blocks
            if segment.mode == "last_segment" and segment.start > record.local_tokens:
                shown = block_view(blocks, segment.start // self.block_size)
            alloc(request, shown, segment.tokens)  # a load the scheduler counts: errors go up

    def _ship_round(
        self, record: LoadRecord, req_id: str, segments: Sequence[Segment], block_ids: list[int]
    ) -> None:
        """Put one round of a stitched load (its first, or a recovery's) into this step's
        metadata: the sync segments, which the worker half checks this step, and while the
        load is in flight its ``StitchLoad`` (the children awaited, each segment's blocks and
        what is given up); a load already complete gives its lost blocks up as plain invalid
        blocks."""
        sync = tuple((s.child, s.block_ids) for s in segments if not s.is_async)
        if sync:
            self._sync_segments[req_id] = sync
        lost = self._given_up(record, req_id, block_ids)
        if record.state is LoadState.LOADING:
            self._stitches[req_id] = StitchLoad(
                record.awaiting,
                {s.child: s.block_ids for s in segments},
                lost,
                record.lost_from is not None and not self.block_level_failures,
            )
        else:
            self._invalid_blocks.extend(lost)

    def _given_up(self, record: LoadRecord, req_id: str, block_ids: list[int]) -> tuple[int, ...]:
        """The blocks of the grant no segment loads (from ``lost_from`` on), reported invalid
        on a single KV cache group. On several groups a parked request goes up failed instead
        (``StitchLoad.failed``); a sync one has no way to say it, and is refused."""
        lost = record.lost_from
        if lost is None or not self.block_level_failures:
            if lost is not None and record.state is not LoadState.LOADING:
                raise LedgerError(
                    f"request {req_id}: vLLM's grant ends "
                    f"inside an uncuttable segment of a sync stitched load on a model with "
                    "several KV cache groups, where vLLM takes neither invalid blocks nor a "
                    "failed receive; do not stitch such a child there"
                )
            return ()
        bs = self.block_size
        return tuple(block_ids[lost // bs : -(-record.load_end // bs)])

    # ------------------------------------------------------------ what vLLM asks
    def hit_sources(self, record: LoadRecord, request: Request) -> dict[Any, int]:
        """Each segment's child splits its own tokens by tier; the splits are summed."""
        merged: dict[Any, int] = {}
        for s in record.segments:
            if s.active:
                default = self._base_hit_sources(request, s.tokens)
                part = self.children.call(
                    s.child, "get_external_cache_hit_sources", default, request, s.tokens
                )
                for key, count in part.items():
                    merged[key] = merged.get(key, 0) + count
        return merged

    def group_ids(self, record: LoadRecord, request: Request) -> tuple[int, ...]:
        """The KV cache groups every segment's child restores."""
        groups: set[int] | None = None
        for child in record.loaders():
            mine = set(self.children.connectors[child].get_loaded_kv_cache_group_ids(request))
            groups = mine if groups is None else groups & mine
        return tuple(sorted(groups or ()))

    # ------------------------------------------------------------------ recovery
    def recover(self, req_ids: list[str]) -> None:
        """Plan the next round of each stitched load whose round ended with a failed segment
        (``LoadState.RECOVERING``; its receive was held back). Called at the start of
        ``build_connector_meta``, so that the reloading children's loads go out in this step's
        metadata and no abort can come between a child's allocation and its metadata."""
        for req_id in req_ids:
            record = self.ledger.get(req_id)
            if record is None or record.state is not LoadState.RECOVERING:
                # aborted since: vLLM holds the blocks until one receive comes
                self._stitches[req_id] = StitchLoad((), {})
                continue
            reloads, lost = self._plan_reloads(record)
            self.ledger.recovered(record, reloads, lost)
            self._ship_round(record, req_id, reloads, list(record.blocks.get_block_ids()[0]))

    def _plan_reloads(self, record: LoadRecord) -> tuple[tuple[Segment, ...], int | None]:
        """Reload segments for the record's failed ranges (told to their children), and where
        the load is given up (None: nowhere). A child reloads at most one range per round; on
        several KV cache groups every range is reloaded whole or none is (the request fails:
        vLLM takes no invalid blocks there)."""
        lost = record.lost_from
        block_level = self.block_level_failures
        reloads: list[Segment] = []
        used: set[int] = set()
        for start, end in _failed_ranges(record.segments):
            if lost is not None and start >= lost:
                continue  # recomputed anyway
            found = self._find_reload(record, start, end, used)
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
            if not self._tell_reload(record, r):
                lost = r.start if lost is None else min(lost, r.start)
                break
            told.append(r)
        return tuple(told), lost

    def _find_reload(
        self, record: LoadRecord, start: int, end: int, used: set[int]
    ) -> Segment | None:
        """The first able child's reload of ``[start, end)`` (or of the part from ``start`` it
        holds, if it can be cut); None if no child can. Able: ``native``, not excluded (the
        failed children are), not out of lookups, not reloading another range this round, its
        alignment dividing ``start``."""
        request = record.request
        disabled = self.guard.disabled
        for child, support in enumerate(self._lookup.range_supports):
            if (
                support.mode != "native"
                or child in record.excluded
                or child in disabled
                or child in used
                or start % (support.align or self.block_size)
            ):
                continue
            tokens, is_async = self._lookup.ask(child, request, start)
            if not tokens or tokens <= 0:
                continue
            take = min(tokens, end - start)
            if take < tokens and not support.can_cut:
                continue
            return Segment(
                child, start, start + take, is_async, support.mode, support.can_cut, reload=True
            )
        return None

    def _tell_reload(self, record: LoadRecord, reload: Segment) -> bool:
        """Hand ``reload`` to its child (its range, then the allocation with the request's
        blocks); False if the child raised (a miss)."""
        request, blocks = record.request, record.blocks
        child = reload.child
        place((reload,), list(blocks.get_block_ids()[0]), self.block_size)
        try:
            set_range = getattr(self.children.connectors[child], "set_load_range", None)
            if set_range is not None:
                set_range(request.request_id, reload.start, reload.end)
            self.allocs[child](request, blocks, reload.tokens)
        except Exception as exc:
            self.guard.child_error(child, "update_state_after_alloc", exc)
            return False
        reload.state = SegmentState.LOADING if reload.is_async else SegmentState.LOADED
        name = self.children.names[child]
        self.counters.inc(f"reloads.{name}")
        self.counters.inc(f"reloaded_tokens.{name}", reload.tokens)
        return True


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
