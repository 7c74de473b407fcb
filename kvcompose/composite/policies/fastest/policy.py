"""``fastest``: every candidate is asked at the local hit, and the plan with the least
predicted time to first token is taken (``kvcompose.composite.policies.fastest.search``): no
segment (recompute), one, or several, each segment that starts later asked again *there*, as
a stitch asks. Each load of the plan awaits its time from the worker half, which fits the
child's line (``kvcompose.composite.policies.fastest.costs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcompose.composite.policies.base import (
    MISS,
    RECOMPUTE,
    LookupPolicy,
    Plan,
    PolicySetting,
)
from kvcompose.composite.policies.fastest import search
from kvcompose.composite.policies.fastest.costs import Costs
from kvcompose.composite.segments import Segment

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: The ``plans.<kind>`` counters of a recompute and of one child's load
_PLAN_RECOMPUTE, _PLAN_LOAD = search.PLAN_COUNTERS[:2]


class FastestLookup(LookupPolicy):
    name = "fastest"
    stops_at_pending = False
    times_loads = True
    weighs_every_hit = True

    def __init__(self, setting: PolicySetting) -> None:
        super().__init__(setting)
        assert setting.vllm_config is not None  # the KV bytes a token price every load
        self.costs: Costs = Costs.for_tree(setting.tree, setting.vllm_config)  # type: ignore[arg-type]
        self.planner = search.Planner(self.supports, self.block_size)

    # ------------------------------------------------------------ the general rule
    def take(self, plan: list[Segment], segment: Segment) -> bool:
        plan.append(segment)  # every hit is weighed
        return False

    def finish(
        self, request: Request, local: int, plan: list[Segment], trace: list[str] | None
    ) -> Plan:
        """The cheapest plan (``Planner.choose``); with a debug trace, every plan weighed is
        listed in it (the decision log)."""
        if not plan:
            return ()
        hits = [search.Hit(s.child, s.end, s.is_async) for s in plan]
        weighed: list[search.Choice] | None = [] if trace is not None else None
        choice = self.planner.choose(
            request.request_id, hits, local, request.num_tokens, self.costs, weighed
        )
        if weighed is not None and trace is not None:
            names = self.counters.child_names
            trace.append("plans: " + "; ".join(c.describe(names) for c in weighed))
        return self._realise(request, local, choice)

    def _realise(self, request: Request, local: int, choice: search.Choice) -> Plan:
        """The chosen plan's segments, each that starts after ``local`` asked again there;
        an answer that cannot carry the plan ends it there (the rest is recomputed). A part
        at ``local`` is its child's answer there, or (a child that can be cut) a cut of it:
        it is taken as planned."""
        host = self.host
        plan: list[Segment] = []
        for part in choice.parts:
            support = self.supports[part.child]
            if part.start == local:
                plan.append(
                    Segment(
                        part.child, local, part.end, part.is_async, support.mode, support.can_cut
                    )
                )
                continue
            tokens, is_async = host.ask(part.child, request, part.start)
            if not tokens or tokens <= 0:
                break
            end = part.start + tokens
            if not is_async and end >= request.num_tokens:
                end = part.start + host.leave_one(part.child, request, part.start, tokens)
            if end < part.end or (end > part.end and not support.can_cut):
                if end <= part.start or not support.can_cut:
                    break
                plan.append(Segment(part.child, part.start, end, is_async, support.mode, True))
                break  # shorter than planned: the rest is recomputed
            plan.append(
                Segment(part.child, part.start, part.end, is_async, support.mode, support.can_cut)
            )
        return tuple(plan) if plan else RECOMPUTE

    def repeat(self, req_id: str) -> None:
        # priced without its own unstarted plan: no queue in front of itself
        self.costs.forget(req_id)

    def decided(self, req_id: str, plan: Plan, counted: bool) -> None:
        """The plan counted (a recompute weighed against hits too), and each segment's load
        expected: it awaits its time from the worker half."""
        if counted and (plan or plan is RECOMPUTE):
            self.counters.inc(search.PLAN_COUNTERS[min(len(plan), 2)])
        costs = self.costs
        costs.forget(req_id)
        for s in plan:
            predicted = costs.loads[s.child].predict(s.tokens)
            costs.expect(req_id, s.child, s.tokens, predicted, s.is_async)

    # ------------------------------------------------------------ the common case
    # (typed and documented by ``LookupPolicy.settle``; ``longest``: where the longest hit ends)
    def settle(self, request, local, child, longest, is_async, hits, any_async, num_tokens):  # type: ignore[no-untyped-def]
        """The cheapest plan on ``hits`` (without the list of every plan weighed, which only
        the debug trace shows), realised and recorded as the general rule does."""
        req_id = request.request_id
        if not num_tokens:
            num_tokens = request.num_tokens
        costs = self.costs
        planner = self.planner
        reason = self.fixed_reason
        # (no ``costs.forget`` as ``decided`` does: a request without a record, which is all
        # this path sees, has no load awaiting its time; those are given out with a record,
        # which is kept until the request finishes)
        assert hits is not None  # (``weighs_every_hit``)
        if costs.warm_for_good and not any_async:
            # what ``choose`` would do, without its checks, its objects and ``_realise``:
            # a first-level plan starts at ``local``, so none of its children is asked
            # again (one warm sync hit too: the scan prices it as ``choose``'s ``_one``)
            recompute_s = (num_tokens - local) / costs.prefill_tokens_per_s
            found = planner.scan(hits, local, num_tokens, costs, recompute_s, longest)  # type: ignore[arg-type]
            if found is not None:
                child, end, _, load_s = found
                if child < 0:
                    self.counters.inc(_PLAN_RECOMPUTE)
                    return MISS
                # one child's sync load from ``local``, without a segment object (the
                # ledger keeps only its owner), its plan and hit counted in one call
                tokens = end - local
                costs.expect(req_id, child, tokens, load_s, False)
                self.ledger.decide(req_id, child, tokens, False, reason, local)
                self.counters.plan_hit(_PLAN_LOAD, child, tokens)
                return tokens, False
        choice = planner.choose(req_id, hits, local, num_tokens, costs)  # type: ignore[arg-type]
        if len(choice.parts) != 1:
            return self.host.record(
                req_id, self._realise(request, local, choice), reason, local, None
            )
        child, _, end, is_async = choice.parts[0]
        # one child loads from ``local``, as above
        tokens = end - local
        costs.expect(req_id, child, tokens, costs.loads[child].predict(tokens), is_async)
        self.ledger.decide(req_id, child, tokens, is_async, reason, local)
        self.counters.plan_hit(_PLAN_LOAD, child, tokens)
        return tokens, is_async
