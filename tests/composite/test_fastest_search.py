"""``policy: fastest``'s plan search (``kvcompose.composite.policies.fastest.search.Planner``)
picks what the exhaustive enumeration it replaced picked: the same plan (parts) at the same
predicted time, to the last bit, and, asked for the decision log, weighs the same plans in the
same order.

The enumeration is kept here as the reference (as it was in ``fastest.py`` before the
search): every plan the range modes allow, generated recursively, each priced from scratch by
``predict``, the first cheapest kept, cheaper meaning cheaper by more than ``BETTER_BY``
(before the search, by any amount: that rule's pick may differ only by rounding, which is
checked too). A cold child's first probe (``Costs.free_probe``, a segment of a cold child
that can be cut) is priced at nothing, here as in the search. Drawn at random: hits (sync and
async, ends on and off the block grid), range modes, alignments, cuttability, children whose
async loads are read inline (priced as sync ones), priors (equal ones too), cold children
(first probes, second ones, and ones left out while another request's load awaits its time),
queues of async loads, prefill speeds."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

import pytest

from kvcompose.composite.policies.fastest.costs import Costs, LoadCost
from kvcompose.composite.policies.fastest.search import BETTER_BY, Choice, Hit, Part, Planner
from kvcompose.tree.ranges import RANGE_MODES, RangeSupport

BLOCK = 16


# ----------------------------------------------------------------- the reference
def predict(
    parts: Sequence[Part],
    num_tokens: int,
    local: int,
    supports: Sequence[RangeSupport],
    costs: Costs,
) -> float:
    sync = 0.0
    waits = 0.0
    for p in parts:
        if supports[p.child].can_cut and costs.free_probe(p.child):
            load = 0.0  # a cold child's first probe: bought to be timed
        else:
            load = costs.loads[p.child].predict(p.end - p.start)
        if p.is_async and not supports[p.child].loads_inline:
            waits = max(waits, costs.queue_s(p.child) + load)
        else:
            sync += load
    end = parts[-1].end if parts else local
    return sync + waits + costs.compute_s(num_tokens - end)


def reference(
    req_id: str,
    hits: Sequence[Hit],
    local: int,
    num_tokens: int,
    supports: Sequence[RangeSupport],
    costs: Costs,
) -> tuple[Choice, list[Choice]]:
    hits = [h for h in hits if costs.usable(h.child, req_id)]
    weighed = [
        Choice(parts, predict(parts, num_tokens, local, supports, costs))
        for parts in _plans(hits, local, supports, BLOCK, costs)
    ]
    best = weighed[0]
    for choice in weighed[1:]:
        if choice.predicted_s < best.predicted_s * (1 - BETTER_BY):
            best = choice
    return best, weighed


def choose(
    req_id: str,
    hits: Sequence[Hit],
    local: int,
    num_tokens: int,
    supports: Sequence[RangeSupport],
    block_size: int,
    costs: Costs,
    weighed: list[Choice] | None = None,
) -> Choice:
    return Planner(supports, block_size).choose(req_id, hits, local, num_tokens, costs, weighed)


def _plans(
    hits: Sequence[Hit],
    local: int,
    supports: Sequence[RangeSupport],
    block_size: int,
    costs: Costs,
) -> Iterator[tuple[Part, ...]]:
    by_child = {h.child: h for h in hits}

    def extend(pos: int, parts: tuple[Part, ...]) -> Iterator[tuple[Part, ...]]:
        yield parts
        if parts and supports[parts[-1].child].mode in ("sole_owner", "last_segment"):
            return
        used = {p.child for p in parts}
        any_async = any(p.is_async for p in parts)
        sync_only = any(supports[p.child].mode == "natural_end" for p in parts)
        for hit in hits:
            support = supports[hit.child]
            mode = support.mode
            if hit.child in used or hit.end <= pos:
                continue
            if mode == "sole_owner" and parts:
                continue
            if mode == "natural_end" and any_async:
                continue
            if hit.is_async and (sync_only or mode == "natural_end"):
                continue
            align = support.align or block_size
            if pos % align or pos % block_size:
                continue
            ends = _ends(hit, pos, support, by_child, used, supports, block_size)
            probe_tokens = costs.probe_tokens(hit.child)
            if probe_tokens is not None and support.can_cut:
                unit = math.lcm(align, block_size)
                probe = pos + math.ceil(probe_tokens / unit) * unit
                if hit.end > probe:
                    ends = [e for e in ends if e < probe] + [probe]
            for end in ends:
                yield from extend(end, (*parts, Part(hit.child, pos, end, hit.is_async)))

    yield from extend(local, ())


def _ends(
    hit: Hit,
    pos: int,
    support: RangeSupport,
    by_child: dict[int, Hit],
    used: set[int],
    supports: Sequence[RangeSupport],
    block_size: int,
) -> list[int]:
    ends = [hit.end]
    if support.can_cut:
        for other in by_child.values():
            if other.child == hit.child or other.child in used or other.end <= hit.end:
                continue
            step = math.lcm(supports[other.child].align or block_size, block_size)
            cut = hit.end // step * step
            if pos < cut < hit.end and cut not in ends:
                ends.append(cut)
    return ends


# ----------------------------------------------------------------- random draws
class Frozen:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def draw(rng: random.Random) -> tuple[list[Hit], int, int, list[RangeSupport], Costs]:
    """One lookup: up to 5 children, what each holds and how it may be loaded, and costs."""
    k = rng.randint(1, 5)
    local = rng.choice([0, 0, 16, 32, 64])
    num_tokens = local + rng.choice([48, 96, 160, 300, 700])
    supports = [
        RangeSupport(
            rng.choice(RANGE_MODES),  # type: ignore[arg-type]
            rng.choice([None, None, 16, 32, 48, 64, 8]),
            rng.random() < 0.6,
            "drawn",
            loads_inline=rng.random() < 0.3,
        )
        for _ in range(k)
    ]
    hits = []
    for child in range(k):
        if rng.random() < 0.15:
            continue  # no hit
        blocks = rng.random() < 0.7
        span = num_tokens - local
        tokens = rng.randint(1, span // BLOCK) * BLOCK if blocks else rng.randint(1, span)
        hits.append(Hit(child, local + min(tokens, span), rng.random() < 0.3))
    rng.shuffle(hits)  # the children answer in the chain's order; any order must do
    hits.sort(key=lambda h: h.child)
    clock = Frozen()
    # equal priors (exact ties between plans in real arithmetic) as often as drawn ones
    same = rng.random() < 0.3
    latency = rng.choice([0.0, 0.001, 0.02])
    rate = rng.choice([1024.0, 1e3, 2e4, 1e6, 1e12])  # 1,024: as fast as computing, below
    loads = []
    for _ in range(k):
        load = LoadCost(
            latency if same else rng.choice([0.0, rng.uniform(0, 0.05)]),
            rate if same else 10 ** rng.uniform(2, 7),
            prior_given=rng.random() < 0.8,
        )
        for _ in range(rng.choice([0, 0, 1, 3])):
            load.observe(rng.randint(16, 600), rng.uniform(0.001, 0.5))
        loads.append(load)
    costs = Costs(loads, rng.choice([1024.0, 50.0, 2000.0, 1e5, 10 ** rng.uniform(2, 5)]), clock)
    for child in range(k):
        for other in range(rng.choice([0, 0, 1, 2])):  # other requests' loads in flight
            costs.expect(f"other-{other}", child, 128, rng.uniform(0, 0.3), rng.random() < 0.6)
    clock.t += rng.uniform(0, 0.2)
    return hits, local, num_tokens, supports, costs


@pytest.mark.parametrize("seed", range(8))
def test_the_search_picks_what_the_enumeration_picked(seed):
    rng = random.Random(20261203 + seed)
    searched = stitches = probes = 0
    for case in range(1500):
        hits, local, num_tokens, supports, costs = draw(rng)
        want, every = reference("r", hits, local, num_tokens, supports, costs)
        got = choose("r", hits, local, num_tokens, supports, BLOCK, costs)
        assert got == want, f"seed {seed} case {case}: {hits}, local {local}, {supports}"
        weighed: list[Choice] = []
        logged = choose("r", hits, local, num_tokens, supports, BLOCK, costs, weighed)
        assert logged == want
        assert weighed == every  # the decision log lists every plan, in the same order
        # against the rule before rounding-wide ties (strictly cheaper, in floating point):
        # a different plan only where the two differ by rounding
        exact = min(every, key=lambda c: c.predicted_s)  # the first of the cheapest
        if exact.parts != got.parts:
            assert got.predicted_s - exact.predicted_s <= BETTER_BY * got.predicted_s
        searched += len(every) > 2
        stitches += len(want.parts) > 1
        probes += any(supports[p.child].can_cut and costs.free_probe(p.child) for p in want.parts)
    # the draws exercise the search, not only its shortcuts: many lookups weigh several
    # plans, stitches win some, and first probes (priced at nothing) are taken in some
    assert searched > 500 and stitches > 10 and probes > 10, (searched, stitches, probes)


@pytest.mark.parametrize("children", [1, 2])
def test_a_load_that_costs_what_computing_costs_is_not_chosen(children):
    """Loading must strictly pay: children as fast as the engine computes (1,024 tokens/s, no
    latency: every plan costs exactly 96 / 1,024 s) leave the request to recompute, with one
    child (answered without the walk) as with two (the walk)."""
    costs = Costs([LoadCost(0.0, 1024.0, prior_given=True) for _ in range(children)], 1024.0)
    supports = [RangeSupport("native", None, True, "test")] * children
    hits = [Hit(child, 64 - 16 * child, False) for child in range(children)]
    assert choose("r", hits, 0, 96, supports, BLOCK, costs) == Choice((), 96 / 1024)
    costs.loads[-1].tokens_per_s = 2048.0  # the last child now reads faster than computing
    assert choose("r", hits, 0, 96, supports, BLOCK, costs).parts[-1].child == children - 1


def test_nested_prefixes_at_equal_priors_need_no_walk(monkeypatch):
    """The overhead benchmark's lookup: four sync children holding the prompt less 1..4
    blocks at one fast prior. Every stitch costs what the longest hit's one segment costs
    (in exact arithmetic), so the bound ends the search after that segment: the walk is not
    started, and the longest hit is loaded."""
    import kvcompose.composite.policies.fastest.search as fastest

    def no_walk(*args: object) -> None:
        raise AssertionError("walked")

    monkeypatch.setattr(fastest, "_Walk", no_walk)
    costs = Costs([LoadCost(0.0, 1e8, prior_given=True) for _ in range(4)], 2000.0)
    supports = [RangeSupport("native", None, True, "test")] * 4
    hits = [Hit(child, 96 - 16 * (child + 1), False) for child in range(4)]
    got = choose("r", hits, 0, 96, supports, BLOCK, costs)
    assert got.parts == (Part(0, 0, 80, False),)
    assert got == reference("r", hits, 0, 96, supports, costs)[0]


def test_the_scan_bound_follows_every_change_of_a_line():
    """``Planner.scan`` bounds a plan by ``Costs.fastest_rate`` and trusts
    ``Costs.lines_bounded``, kept as the lines change, not per lookup: a line set by
    ``observe`` or directly (as tests do) refreshes both."""
    costs = Costs([LoadCost(0.0, 1000.0, prior_given=True) for _ in range(2)], 2000.0)
    assert costs.fastest_rate == 1000.0 and costs.lines_bounded
    costs.loads[1].tokens_per_s = 4000.0
    assert costs.fastest_rate == 4000.0
    costs.loads[1].observe(400, 0.001)  # 400,000 tokens/s, read as all rate
    assert costs.fastest_rate == costs.loads[1].tokens_per_s > 4000.0
    costs.loads[0].latency_s = -0.001
    assert not costs.lines_bounded
    supports = [RangeSupport("native", None, True, "test")] * 2
    hits = [Hit(0, 64, False), Hit(1, 32, False)]
    assert Planner(supports, BLOCK).scan(hits, 0, 96, costs, 96 / 2000.0, 64) is None


def test_async_loads_read_inline_are_priced_one_after_the_other():
    """The prefix store on several KV cache groups loads async (a failure goes up by
    request) but reads each load inside its worker's ``start_load_kv``, one after the
    other. At equal priors a stitch ``a[0,160) + b[160,192)`` then pays two latencies, and
    b's whole hit (one latency) wins; priced as parallel loads, the stitch looked cheaper."""
    costs = Costs([LoadCost(0.001, 1e6, prior_given=True) for _ in range(2)], 2000.0)
    hits = [Hit(0, 160, True), Hit(1, 192, True)]
    inline = [RangeSupport("native", None, True, "test", loads_inline=True)] * 2
    got = choose("r", hits, 0, 200, inline, BLOCK, costs)
    assert got.parts == (Part(1, 0, 192, True),)
    assert got == reference("r", hits, 0, 200, inline, costs)[0]
    parallel = [RangeSupport("native", None, True, "test")] * 2
    assert choose("r", hits, 0, 200, parallel, BLOCK, costs).parts == (
        Part(0, 0, 160, True),
        Part(1, 160, 192, True),
    )
