"""The segments of one stitched load, and their state machine.

A stitched load (``chain`` with ``policy: stitch``) reads one request's KV from several
children, each its own token range. On several KV cache groups a parked sync load
(``Ledger.park``) is a stitched load of one segment, so that it takes the stitched rounds and
recovery. The scheduler half records one ``Segment`` per child that loads, in the request's
``LoadRecord`` (``kvcompose.composite.ledger``)::

                  alloc: in the grant                       the receive
    PLANNED ──┬──────────────────────────▶ LOADING (async) ──┬──────────▶ LOADED
              │  (cut to the grant's end                      │
              │   when it straddles it)     LOADED (sync) ────┤ the worker: its load failed
              │                                               ▼
              │                                             FAILED ── recovery ──▶ REPLACED
              ├─ alloc: past the grant's end ─────────────────▶ DROPPED (told 0)
              └─ alloc: straddles the grant's end, cannot be cut ▶ DROPPED (told 0; its part
                                                                  of the grant is lost)

A **recovery** (``kvcompose.composite.stitch.StitchPlanner.recover``) gives a failed
segment's range to a new segment of another child, a *reload* (``reload=True``) that starts
``LOADING`` or ``LOADED`` like any other, or gives the range up (vLLM recomputes it). Segments
are appended in load rounds: the first round is the lookup's, each recovery adds one.

The request is loaded when no segment is ``LOADING`` and none is ``FAILED``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks


class SegmentState(enum.Enum):
    PLANNED = "planned"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    REPLACED = "replaced"  # failed, and its range reloaded by another segment or given up
    DROPPED = "dropped"


class SegmentError(RuntimeError):
    """A grant the segments cannot honour (a cut inside a segment that cannot be cut)."""


@dataclass(slots=True)
class Segment:
    """Child ``child`` loads tokens ``[start, end)`` (``block_ids``: the blocks it writes,
    group 0, filled at allocation)."""

    child: int
    start: int
    end: int
    is_async: bool
    mode: str
    can_cut: bool
    block_ids: tuple[int, ...] = ()
    state: SegmentState = SegmentState.PLANNED
    reload: bool = False  # a recovery's: reloads (part of) a failed segment's range

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def active(self) -> bool:
        """Whether its range is (being) loaded by it: not dropped, not replaced."""
        return self.state is not SegmentState.DROPPED and self.state is not SegmentState.REPLACED

    def as_dict(self, names: list[str] | None = None) -> dict[str, object]:
        return {
            "child": self.child if names is None else names[self.child],
            "range": [self.start, self.end],
            "async": self.is_async,
            "mode": self.mode,
            "blocks": len(self.block_ids),
            "state": self.state.value,
            **({"reload": True} if self.reload else {}),
        }


def grant(segments: tuple[Segment, ...], local: int, granted: int) -> int | None:
    """vLLM granted ``granted`` of the promised tokens after ``local``: segments past the
    grant's end are dropped, the one straddling it is cut if it can be and dropped if it
    cannot, and the others start loading. Returns where the dropped uncut segment began (its
    range up to the grant's end is counted by vLLM but loaded by no one), or None."""
    limit = local + granted
    lost: int | None = None
    for seg in segments:
        if seg.state is not SegmentState.PLANNED:
            raise SegmentError(f"segment of child {seg.child} allocated twice ({seg.state})")
        if seg.start >= limit:
            seg.state = SegmentState.DROPPED
        elif seg.end > limit:
            if seg.can_cut:
                seg.end = limit
            else:
                seg.state = SegmentState.DROPPED
                lost = seg.start if lost is None else min(lost, seg.start)
    for seg in segments:
        if seg.state is SegmentState.PLANNED:
            seg.state = SegmentState.LOADING if seg.is_async else SegmentState.LOADED
    return lost


def place(segments: tuple[Segment, ...], block_ids: list[int], block_size: int) -> None:
    """Record the blocks each active segment writes (group 0)."""
    for seg in segments:
        if seg.active:
            seg.block_ids = tuple(block_ids[seg.start // block_size : -(-seg.end // block_size)])


def fail(segments: tuple[Segment, ...], child: int) -> Segment | None:
    """The worker reported ``child``'s load of the current round failed: its last segment
    still loading or loaded (a child loads at most one segment per round)."""
    for seg in reversed(segments):
        if seg.child == child and seg.state in (SegmentState.LOADING, SegmentState.LOADED):
            seg.state = SegmentState.FAILED
            return seg
    return None


def settle(segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """The round's one receive arrived: every async segment still loading has loaded.
    Returns the failed segments, which await a recovery."""
    for seg in segments:
        if seg.state is SegmentState.LOADING:
            seg.state = SegmentState.LOADED
    return tuple(s for s in segments if s.state is SegmentState.FAILED)


def block_view(blocks: KVCacheBlocks, first_block: int) -> KVCacheBlocks:
    """The request's blocks from ``first_block`` on, every group (for a ``last_segment``
    child, which loads every unhashed block it is handed)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(tuple(group[first_block:] for group in blocks.blocks))
