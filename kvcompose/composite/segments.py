"""The segments of one stitched load, and their state machine.

A stitched load (``chain`` with ``policy: stitch``) reads one request's KV from several
children, each its own token range. The scheduler half records one ``Segment`` per child that
loads, in the request's ``LoadRecord`` (``kvcompose.composite.ledger``)::

                  alloc: in the grant                       the receive
    PLANNED ──┬──────────────────────────▶ LOADING (async) ──┬──────────▶ LOADED
              │  (cut to the grant's end                      └─ failed ─▶ FAILED
              │   when it straddles it)     LOADED (sync)
              └─ alloc: past the grant's end ─▶ DROPPED (told 0)

The request is loaded when no segment is ``LOADING``; it failed if any segment did.
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

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def active(self) -> bool:
        return self.state is not SegmentState.DROPPED

    def as_dict(self, names: list[str] | None = None) -> dict[str, object]:
        return {
            "child": self.child if names is None else names[self.child],
            "range": [self.start, self.end],
            "async": self.is_async,
            "mode": self.mode,
            "blocks": len(self.block_ids),
            "state": self.state.value,
        }


def grant(segments: tuple[Segment, ...], local: int, granted: int) -> None:
    """vLLM granted ``granted`` of the promised tokens after ``local``: segments past the
    grant's end are dropped, the one straddling it is cut (if it can be), and the others
    start loading."""
    limit = local + granted
    for seg in segments:
        if seg.state is not SegmentState.PLANNED:
            raise SegmentError(f"segment of child {seg.child} allocated twice ({seg.state})")
        if seg.start >= limit:
            seg.state = SegmentState.DROPPED
        elif seg.end > limit:
            if not seg.can_cut:
                raise SegmentError(
                    f"vLLM granted {granted} tokens, ending inside the [{seg.start}, "
                    f"{seg.end}) segment of child {seg.child} ({seg.mode}), which cannot "
                    "be cut short; do not stitch such a child where vLLM rounds grants"
                )
            seg.end = limit
    for seg in segments:
        if seg.active:
            seg.state = SegmentState.LOADING if seg.is_async else SegmentState.LOADED


def place(segments: tuple[Segment, ...], block_ids: list[int], block_size: int) -> None:
    """Record the blocks each active segment writes (group 0)."""
    for seg in segments:
        if seg.active:
            seg.block_ids = tuple(block_ids[seg.start // block_size : -(-seg.end // block_size)])


def received(segments: tuple[Segment, ...], child: int, failed: bool) -> bool:
    """``child``'s async segment finished. Returns whether it was loading."""
    for seg in segments:
        if seg.child == child and seg.state is SegmentState.LOADING:
            seg.state = SegmentState.FAILED if failed else SegmentState.LOADED
            return True
    return False


def loading(segments: tuple[Segment, ...]) -> tuple[int, ...]:
    """The children whose async segments are still in flight."""
    return tuple(s.child for s in segments if s.state is SegmentState.LOADING)


def block_view(blocks: KVCacheBlocks, first_block: int) -> KVCacheBlocks:
    """The request's blocks from ``first_block`` on, every group (for a ``last_segment``
    child, which loads every unhashed block it is handed)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(tuple(group[first_block:] for group in blocks.blocks))
