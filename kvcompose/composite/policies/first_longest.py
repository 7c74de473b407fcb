"""``first`` and ``longest``: one child owns the load, its ``[local, local + n)``.

``first``: the candidates are asked in order and the first hit owns (the rest are not asked,
unless the node asks every child as vLLM's MultiConnector does); a child still answering
``None`` ahead of it holds the decision. ``longest``: every candidate is asked, the largest
hit owns, ties go to the earlier child. Fan-out and route nodes take ``first`` over the
candidates they choose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcompose.composite.policies.base import LookupPolicy, PolicySetting

if TYPE_CHECKING:
    from kvcompose.composite.segments import Segment


class _OneOwner(LookupPolicy):
    """A policy whose plan is one child's load: its common case records the owner."""

    # (typed and documented by ``LookupPolicy.settle``)
    def settle(self, request, local, child, end, is_async, hits, any_async, num_tokens):  # type: ignore[no-untyped-def]
        if hits is not None:  # every hit (``first`` asking every child): the first owns
            child, end, is_async = hits[0]
        tokens = end - local
        self.ledger.decide(request.request_id, child, tokens, is_async, self.fixed_reason, local)
        self.counters.hit(child, tokens)
        return tokens, is_async


class FirstLookup(_OneOwner):
    name = "first"

    def __init__(self, setting: PolicySetting) -> None:
        super().__init__(setting)
        self.stops_at_hit = not setting.ask_every_child
        # asked after the first hit too (``ask_every_child``): the first hit, not the longest
        self.weighs_every_hit = setting.ask_every_child

    def take(self, plan: list[Segment], segment: Segment) -> bool:
        if plan:
            return False  # asked after the owner (``ask_every_child``): the first hit owns
        plan.append(segment)
        return self.stops_at_hit


class LongestLookup(_OneOwner):
    name = "longest"
    stops_at_pending = False

    def take(self, plan: list[Segment], segment: Segment) -> bool:
        if not plan or segment.tokens > plan[0].tokens:  # ties go to the earlier child
            plan[:] = [segment]
        return False
