"""``policy: fastest``: the plan for one request with the least predicted time to first token.

Every child was asked at the local hit ``local`` and answered where its hit ends. The plans
are what the children's range modes allow (``kvcompose.tree.ranges``), as a stitch walks
them, but in any order and with any child left out:

- recompute everything after ``local``;
- one child loads its hit (any mode);
- a stitch: segments one after the other from ``local``, each by a child that can start
  where the previous one ends (its mode and alignment), a segment of a child that can be cut
  short ending early so that another child can start on its alignment; the rest recomputed.

A plan's predicted time (``kvcompose.composite.policies.fastest.costs``): its sync segments one
after the other, its async segments in parallel, each after its child's queue, then the prefill
of what is left. An async segment of a child that loads inline (``RangeSupport.loads_inline``:
the prefix store on several KV cache groups, async so that a failure goes up by request, read in
its worker's ``start_load_kv`` all the same) is priced as a sync one. The cheapest wins. A plan
replaces the best so far only if it is cheaper by more than ``BETTER_BY`` (a billionth) of it:
plans whose predictions differ by floating-point rounding alone are ties, and ties go to the
plan found first (recompute first), so loading must pay to be chosen. A cold child
(``Costs.cold``) with another request's load awaiting its time is left out (``Costs.usable``),
and its segment, where it can be cut, ends at most ``Costs.probe_tokens`` after its start
(rounded up to its alignment): its first times are bought with short loads.

**A cold child's first probe is priced at nothing** (``Costs.free_probe``: a cold child none of
whose loads has been timed, in a segment cut to its probe): it is bought to be timed, and its
cost is bounded by ``Costs.probe_tokens``, one probe in flight at a time (``Costs.usable``),
and only until the first time comes back (the second probe is priced by the line that time
fitted, which reads the time as latency: a first probe ends the probing if that line loses to
computing at every length up to the cap). Priced at the default prior (1 ms + 1 GB/s), the
probe loses to the plan without it whenever another child reads its 128 tokens faster than that
guess: in the fleet benchmark ``local[0,128) + shared[128,S)`` lost to ``shared[0,S)`` by 1-4
ms on every request, so the local tier was never loaded, never timed, and stayed cold. Not the
rate of the child that would otherwise load those tokens: the probe plan would then tie the
plan without it, and whether it is taken would hang on the chain's order (ties go to the plan
found first) and on rounding; a probe followed by computing would tie recompute and lose (found
later), so a lone cold child would never be probed; and a segment's price would hang on the
segment after it, which the walk's running sums (one addition a segment) cannot express. At
nothing, a plan with the probe beats the same plan without it by what its tokens would cost
otherwise, and the first request whose plan can include the child probes it.

**The search** (``Planner.choose``) is a depth-first walk of the plans in one fixed order
(recompute, then each child's segment from ``local`` in the chain's order, each followed by
its extensions), pricing each plan as it extends the one before it: a segment adds its load
to the running sums, so a plan costs one addition, not a pass over its segments, and no plan
is built as an object unless it becomes the best so far. A subtree is skipped when no plan in
it can replace the best so far (``_Walk._bound``): its sums only grow, it computes at least
what the longest hit leaves, and, every hit sync, every token it loads loads at best at the
fastest child's rate. Where children hold prefixes of one another at similar prices, the
longest hit's segment reaches that bound and nothing else is looked at; where every hit is
sync and every child warm, that first level runs inline (``Planner.scan``) and the walk only
starts if an extension cannot be skipped. A miss, and one child answering, are answered
without the walk. The answer is the full enumeration's (every plan priced from scratch in
the walk's order, the first best by the rule above kept), which
``tests/composite/test_fastest_search.py`` keeps as its reference and checks the search
against on random hits, modes, alignments and costs, with the plans weighed (the decision
log's list, built only when asked for: the walk then skips nothing) in the same order.

Ties are rounding-wide, not exact, because exact float ties cannot be searched fast: with
equal priors, one child's 80 tokens and another's 64 plus the first's last 16 cost the same
in exact arithmetic and differ by rounding either way, so the plan an exact comparison keeps
depends on rounding in every such plan, and all of them would have to be priced (the
enumeration before this search did; it could pick a stitch for a 1-ulp gain). Why not a
dynamic program over segment boundaries (the cheapest way to reach each, then the rest
computed): a child loads at most one segment of a plan, so a boundary's state also holds the
children used, and with a few children there are about as many such states as plans.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from kvcompose.composite.policies.fastest.costs import Costs
from kvcompose.tree.ranges import RangeSupport

#: Modes whose segment can only be the plan's last: it loads to its own end.
_LAST = ("sole_owner", "last_segment")
#: A plan replaces the best so far only if it is cheaper by more than this share of it: plans
#: whose predictions differ by less (rounding: one child's 80 tokens, or another's 64 and the
#: first's last 16, at equal priors) are ties, and ties go to the plan found first.
BETTER_BY = 1e-9
_KEEP = 1 - BETTER_BY
#: The share of a subtree's bound, computed in floating point, that its plans surely cost.
_SAFE = 1 - 1e-12


class Hit(NamedTuple):
    """A child's answer at ``local``: it holds the request's tokens up to ``end``. (Named
    tuples: a lookup makes one per hit, and a tuple is made many times faster than a frozen
    dataclass.)"""

    child: int
    end: int
    is_async: bool


class Part(NamedTuple):
    """``child`` loads ``[start, end)``."""

    child: int
    start: int
    end: int
    is_async: bool


#: The ``plans.<kind>`` counter of a plan, by its number of segments (0, 1, 2 or more).
PLAN_COUNTERS = ("plans.recompute", "plans.load", "plans.stitch")


class Choice(NamedTuple):
    parts: tuple[Part, ...]
    predicted_s: float

    def describe(self, names: Sequence[str]) -> str:
        plan = " + ".join(f"{names[p.child]}[{p.start},{p.end})" for p in self.parts)
        return f"{plan or 'recompute'} {self.predicted_s * 1000:.1f} ms"


class Planner:
    """The plan search of one ``fastest`` node: what its children's range modes allow is fixed
    (``supports``, ``block_size``), so it is worked out once, not per lookup."""

    def __init__(self, supports: Sequence[RangeSupport], block_size: int) -> None:
        self.supports = tuple(supports)
        self.block_size = block_size
        # per child: its mode, whether its segment ends a plan, its unit (a segment of it
        # starts on a multiple), whether it can be cut short
        self.static = tuple(
            (s.mode, s.mode in _LAST, math.lcm(s.align or block_size, block_size), s.can_cut)
            for s in self.supports
        )
        #: the children's units' least common multiple: a hit ending on it ends on every unit,
        #: so it is never cut for another child (one ``%`` where a loop over the units took a
        #: generator a lookup)
        self.units_lcm = math.lcm(*{unit for _, _, unit, _ in self.static})
        #: per child: its async loads are read one after the other (``loads_inline``)
        self.inline = tuple(s.loads_inline for s in self.supports)

    def choose(
        self,
        req_id: str,
        hits: Sequence[Hit],
        local: int,
        num_tokens: int,
        costs: Costs,
        weighed: list[Choice] | None = None,
    ) -> Choice:
        """The cheapest plan. ``weighed``, if given, receives every plan weighed (for the
        decision log), in the walk's order, and then no subtree is skipped."""
        cold = costs.any_cold()
        if cold:
            usable = costs.usable
            hits = [h for h in hits if usable(h[0], req_id)]
        recompute = (num_tokens - local) / costs.prefill_tokens_per_s
        if weighed is not None:
            weighed.append(Choice((), recompute))
        elif len(hits) == 1:
            return self._one(hits[0], local, num_tokens, costs, recompute)
        if not hits:
            return Choice((), recompute)
        if weighed is None and not cold and not any(h[2] for h in hits):
            longest = max(h[1] for h in hits)
            found = self.scan(hits, local, num_tokens, costs, recompute, longest)
            if found is not None:
                child, end, total, _ = found
                return Choice((Part(child, local, end, False),) if child >= 0 else (), total)
        return _Walk(self, hits, local, num_tokens, costs, weighed).run(recompute)

    def scan(
        self,
        hits: Sequence[Hit],
        local: int,
        num_tokens: int,
        costs: Costs,
        recompute_s: float,
        longest: int,
    ) -> tuple[int, int, float, float] | None:
        """The walk's first level inline, where every hit is sync (the caller checks) and
        every child warm: each child's segment from ``local`` priced in the walk's order, and
        its extensions skipped by the walk's bound (``_Walk._bound``), every price as the walk
        computes it. ``recompute_s`` is ``(num_tokens - local) / prefill``, ``longest`` where
        the longest hit ends. Returns the cheapest plan as ``(child, end, predicted_s,
        load_s)``, its one segment ``child``'s ``[local, end)`` loading in ``load_s``
        (``LoadCost.predict``'s number), or ``(-1, local, recompute_s, 0.0)``: recompute
        (plain numbers: the lookup's fast path makes no plan object). None (the walk decides)
        as soon as an extension cannot be skipped, or a segment could be cut for another
        child. Where children hold prefixes of one another at similar prices, the longest
        hit's segment reaches the bound and no stitch need be looked at.

        The bound's rate is the fastest child's (``Costs.fastest_rate``, kept as the lines
        change), not the fastest hit's as in the walk: no lower, so the bound is no higher
        than the walk's, still below every plan it skips, and no loop over the hits comes
        before the first segment is priced."""
        prefill = costs.prefill_tokens_per_s
        if prefill <= 0 or not costs.lines_bounded:
            return None
        floor_s = (num_tokens - longest) / prefill
        bound = (longest - local) / costs.fastest_rate + floor_s
        if bound > recompute_s:
            bound = recompute_s
        bound *= _SAFE
        keep = recompute_s * _KEEP  # a plan replaces the best only below this
        best = -1
        best_end = local
        best_s = recompute_s
        best_load = 0.0
        static = self.static
        loads = costs.loads
        for child, end, _ in hits:
            if bound >= keep:
                break  # no plan left can replace the best so far
            _, last, unit, can_cut = static[child]
            if local % unit:
                continue
            if can_cut and end < longest and end % self.units_lcm:
                return None  # it may be cut for another child: the walk weighs those ends
            load = loads[child]
            # the walk's sums to the bit: it adds this load to 0.0 and the (0.0) waits, which
            # leaves a number >= 0 unchanged
            sync = load.latency_s + (end - local) / load.tokens_per_s
            total = sync + (num_tokens - end) / prefill
            if total < keep:
                best, best_end, best_s, best_load = child, end, total, sync
                keep = total * _KEEP
            if last or end >= longest:
                continue
            rest = (longest - end) / costs.fastest_rate + floor_s
            computed = (num_tokens - end) / prefill
            if (sync + (computed if computed < rest else rest)) * _SAFE < keep:
                return None  # its extensions might replace the best: the walk looks
        return best, best_end, best_s, best_load

    def _one(
        self, hit: Hit, local: int, num_tokens: int, costs: Costs, recompute_s: float
    ) -> Choice:
        """One child answered: its segment from ``local`` (cut to a probe for a cold child,
        a first probe priced at nothing) against recomputing, as the walk would weigh them."""
        child, end, is_async = hit
        mode, _, unit, can_cut = self.static[child]
        if (is_async and mode == "natural_end") or local % unit:
            return Choice((), recompute_s)
        load = None
        if can_cut and (probe_tokens := costs.probe_tokens(child)) is not None:
            end = min(end, local + math.ceil(probe_tokens / unit) * unit)
            if costs.free_probe(child):
                load = 0.0  # the walk's: 0 latency + tokens / inf
        if load is None:
            load = costs.loads[child].predict(end - local)
        # the walk's sums, to the bit: sync loads add up from 0, async ones wait in parallel
        if is_async and not self.inline[child]:
            sync, waits = 0.0, max(0.0, costs.queue_s(child) + load)
        else:
            sync, waits = load, 0.0
        total = sync + waits + (num_tokens - end) / costs.prefill_tokens_per_s
        if total < recompute_s * _KEEP:
            return Choice((Part(child, local, end, is_async),), total)
        return Choice((), recompute_s)


class _Walk:
    """The depth-first walk of one lookup's plans (see the module docstring)."""

    __slots__ = (
        "best",
        "best_s",
        "bound_rate",
        "costs",
        "floor_s",
        "hits",
        "local",
        "longest",
        "num_tokens",
        "planner",
        "prefill",
        "prune",
        "rows",
        "weighed",
    )

    def __init__(
        self,
        planner: Planner,
        hits: Sequence[Hit],
        local: int,
        num_tokens: int,
        costs: Costs,
        weighed: list[Choice] | None,
    ) -> None:
        loads = costs.loads
        prefill = costs.prefill_tokens_per_s
        longest = 0
        any_async = False
        fastest_rate = 0.0
        cheap = prefill > 0  # every load costs at least 0: a plan's sums only grow
        static = planner.static
        inline = planner.inline
        for child, end, is_async in hits:
            load = loads[child]
            longest = max(longest, end)
            any_async = any_async or (is_async and not inline[child])
            if static[child][3] and costs.free_probe(child):
                fastest_rate = math.inf  # a first probe loads for nothing (``_row``)
            fastest_rate = max(fastest_rate, load.tokens_per_s)
            cheap = cheap and load.latency_s >= 0 and load.tokens_per_s > 0
        self.planner = planner
        self.costs = costs
        self.hits = hits
        #: each hit's row (``_row``), made when the walk first reaches it
        self.rows: list[tuple | None] = [None] * len(hits)  # type: ignore[type-arg]
        self.local = local
        self.num_tokens = num_tokens
        self.prefill = prefill
        self.weighed = weighed
        self.prune = weighed is None and cheap
        self.longest = longest
        # no plan ends after the longest hit: what it leaves is computed in any plan
        self.floor_s = (num_tokens - longest) / prefill if prefill > 0 else 0.0
        # all sync (or inline): every token a plan loads after a point loads at the fastest
        # rate at best
        self.bound_rate = 0.0 if any_async else fastest_rate
        self.best: tuple[tuple[int, int, int, bool], ...] = ()
        self.best_s = 0.0

    def _row(self, i: int) -> tuple:  # type: ignore[type-arg]
        """What every extension by hit ``i`` reads: its bit among the hits, child, end,
        async, whether it loads in parallel (async, not inline), mode, whether it ends a
        plan, its unit, its load's line, its queue (in parallel),
        its probe length (a cold child that can be cut) and its cuts (the last start of each
        later-ending child below its end, on that child's unit). A first probe
        (``Costs.free_probe``) is priced at nothing: latency 0 and an infinite rate, so its
        load adds exactly 0.0 to the sums."""
        hits, costs, static = self.hits, self.costs, self.planner.static
        child, end, is_async = hits[i]
        mode, last, unit, can_cut = static[child]
        parallel = is_async and not self.planner.inline[child]
        load = costs.loads[child]
        latency, rate = load.latency_s, load.tokens_per_s
        probe = None
        cuts: tuple[tuple[int, int], ...] = ()
        if can_cut:
            if (probe_tokens := costs.probe_tokens(child)) is not None:
                probe = math.ceil(probe_tokens / unit) * unit
                if costs.free_probe(child):
                    latency, rate = 0.0, math.inf
            if end < self.longest:
                cuts = tuple(
                    (1 << j, end // static[o[0]][2] * static[o[0]][2])
                    for j, o in enumerate(hits)
                    if o[1] > end
                )
        row = (
            1 << i,
            child,
            end,
            is_async,
            parallel,
            mode,
            last,
            unit,
            latency,
            rate,
            costs.queue_s(child) if parallel else 0.0,
            probe,
            cuts,
        )
        self.rows[i] = row
        return row

    def _bound(self, pos: int, sync: float, waits: float) -> float:
        """The least a plan extending one that ends at ``pos`` (sums ``sync``, ``waits``) can
        cost, in exact arithmetic: its sums only grow, and it computes at least what the
        longest hit leaves; all sync, its tokens from ``pos`` to its end ``E`` load at the
        fastest child's rate at best, so it costs at least ``sync + (E - pos) / rate +
        (n - E) / prefill``, least at ``E = pos`` or at the longest hit."""
        if not self.bound_rate:
            return sync + waits + self.floor_s
        computed = (self.num_tokens - pos) / self.prefill
        loaded = (self.longest - pos) / self.bound_rate + self.floor_s
        return sync + min(computed, loaded)

    def run(self, recompute_s: float) -> Choice:
        """The cheapest plan, recompute (``recompute_s``) the first weighed."""
        self.best_s = recompute_s
        local = self.local
        bound = self._bound(local, 0.0, 0.0) if self.prune else 0.0
        self._extend(local, 0, False, False, 0.0, 0.0, (), bound)
        return Choice(tuple(Part(*p) for p in self.best), self.best_s)

    def _extend(
        self,
        pos: int,
        used: int,
        any_async: bool,
        sync_only: bool,
        sync: float,
        waits: float,
        parts: tuple[tuple[int, int, int, bool], ...],
        bound: float,
    ) -> None:
        """Every plan that extends ``parts`` (ending at ``pos``), each priced, then extended
        in turn; none once ``bound`` (``_bound``, when pruning) shows that no plan extending
        ``parts`` can replace the best so far."""
        num_tokens, prefill, weighed, prune = (
            self.num_tokens,
            self.prefill,
            self.weighed,
            self.prune,
        )
        bound *= _SAFE
        first = not parts
        rows = self.rows
        for i, (_, hit_end, _) in enumerate(self.hits):
            if prune and bound >= self.best_s * _KEEP:
                return  # nothing extending ``parts`` can replace the best so far
            if hit_end <= pos:
                continue
            (
                bit,
                child,
                hit_end,
                is_async,
                parallel,
                mode,
                last,
                unit,
                latency,
                rate,
                queue,
                probe,
                cuts,
            ) = rows[i] or self._row(i)
            if used & bit or pos % unit:
                continue
            if mode == "sole_owner" and not first:
                continue
            if mode == "natural_end" and (any_async or is_async):
                continue
            if is_async and sync_only:
                continue
            ends = [hit_end]
            for other, cut in cuts:
                if not used & other and pos < cut < hit_end and cut not in ends:
                    ends.append(cut)
            if probe is not None and hit_end > pos + probe:
                ends = [e for e in ends if e < pos + probe] + [pos + probe]
            for end in ends:
                load = latency + (end - pos) / rate
                if parallel:
                    s, w = sync, max(waits, queue + load)
                else:
                    s, w = sync + load, waits
                plan = (*parts, (child, pos, end, is_async))
                total = s + w + (num_tokens - end) / prefill
                if weighed is not None:
                    weighed.append(Choice(tuple(Part(*p) for p in plan), total))
                if total < self.best_s * _KEEP:
                    self.best, self.best_s = plan, total
                if last or end >= self.longest:
                    continue  # nothing can follow it
                after = self._bound(end, s, w) if prune else 0.0
                if prune and after * _SAFE >= self.best_s * _KEEP:
                    continue  # nothing extending it can replace the best so far
                self._extend(
                    end,
                    used | bit,
                    any_async or is_async,
                    sync_only or mode == "natural_end",
                    s,
                    w,
                    plan,
                    after,
                )
