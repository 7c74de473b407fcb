"""``stitch``: each hit is a segment of one stitched load, read from several children.

The candidates are asked in order, each where the segments before it end, if its range mode
and alignment let it start there (``kvcompose.tree.ranges``); its hit is the next segment. A
``sole_owner`` child only loads alone, a ``natural_end`` one only in a stitch of sync
segments, and a ``sole_owner`` or ``last_segment`` segment ends the stitch. The stitched
load's allocation, rounds and recovery are ``kvcompose.composite.stitch.StitchPlanner``'s.
Its children are asked where the plan ends, so it has no common case.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcompose.composite.policies.base import LookupPolicy

if TYPE_CHECKING:
    from kvcompose.composite.segments import Segment

#: Modes whose segment ends the stitch: it loads to its own end.
_LAST = ("sole_owner", "last_segment")


class StitchLookup(LookupPolicy):
    name = "stitch"
    asks_where_plan_ends = True
    has_fast_path = False

    def start(self, local: int, plan: Sequence[Segment]) -> int:
        return plan[-1].end if plan else local

    def cannot_ask(self, child: int, at: int, plan: Sequence[Segment]) -> str | None:
        support = self.supports[child]
        if support.mode == "sole_owner" and plan:
            return "skipped(sole owner)"
        if support.mode == "natural_end" and any(s.is_async for s in plan):
            return "skipped(sync stitches only)"
        align = support.align or self.block_size
        if at % align or at % self.block_size:
            return f"skipped(start {at} not on {align})"
        return None

    def synced(self, is_async: bool, plan: Sequence[Segment]) -> bool:
        # sync, and no earlier segment async: vLLM schedules the request right away
        return not (is_async or any(s.is_async for s in plan))

    def refuses(self, segment: Segment, plan: Sequence[Segment]) -> str | None:
        if segment.is_async and any(s.mode == "natural_end" for s in [*plan, segment]):
            return "not taken(async in a sync-only stitch)"
        return None

    def take(self, plan: list[Segment], segment: Segment) -> bool:
        plan.append(segment)
        return segment.mode in _LAST
