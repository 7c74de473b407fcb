"""``policy: fastest`` on vLLM's real scheduler, with scripted children of known cost: the
children's priors (``expect_read``) and the engine's (``expect_prefill_tokens_per_s``) set the
costs, and an injected clock stands for time, so every decision is deterministic. The tests
check the plan each request gets (who loads what, what vLLM is told), not timings."""

from __future__ import annotations

from typing import Any

import pytest
from stitch_helpers import allocs, lookups_at, native, receives

from kvcompose.composite.metadata import ComposedWorkerMeta
from kvcompose.testing.scripted import Behaviour, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

FAST = {"latency_ms": 0.0, "gbps": 1000.0}  # far faster than computing
SLOW = {"latency_ms": 1000.0, "gbps": 1000.0}  # a second a load: slower than computing 200


class Clock:
    """Time that moves only when a test moves it."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fastest(*children: Any, prefill: float = 2000.0) -> dict[str, Any]:
    tree = chain("root", *children, policy="fastest")
    tree["expect_prefill_tokens_per_s"] = prefill
    return kvcompose_config(tree)


def frozen(h: Any) -> Clock:
    """One clock for both halves, frozen: no step measures prefill, no load takes time."""
    clock = Clock()
    h.connector.scheduler_side.costs.clock = clock
    h.worker_connector.worker_side.timer.clock = clock
    return clock


def loads_take(h: Any, clock: Clock, seconds: float) -> None:
    """Every sync load of child 0 moves the injected clock by ``seconds`` while it loads."""
    child = h.worker_connector.worker_side.children.connectors[0]
    loading = child.start_load_kv

    def timed_load(*args: Any, **kwargs: Any) -> None:
        if h.worker_connector.worker_side.timer.loads_sync(0):
            clock.t += seconds
        loading(*args, **kwargs)

    child.start_load_kv = timed_load


def told_for(h: Any, child: Any, prompts: list[list[int]]) -> list[int]:
    """Each prompt run alone to the end: the tokens ``child`` was allocated for it."""
    told = []
    for tokens in prompts:
        req = h.add_request(tokens, max_tokens=1)
        h.run_until_idle()
        told.append(allocs(child, req.request_id)[0])
    return told


def counters(h: Any) -> dict[str, float]:
    return h.connector.stats_totals()["counters"]


def test_recompute_is_chosen_over_a_child_slower_than_computing(harness):
    slow = script("slow", Behaviour(tokens=160))
    h = harness(fastest(native("slow", expect_read=SLOW)))
    frozen(h)
    req = h.add_request(prompt(200, 1), max_tokens=2)
    h.run_until_idle()
    assert allocs(slow, req.request_id) == [0]
    assert counters(h)["plans.recompute"] == 1
    h.assert_clean()


def test_the_fast_childs_prefix_is_loaded_and_the_rest_recomputed(harness):
    """The issue's best plan, which no other policy can choose: fast holds the system prompt
    (64), slow the whole conversation (199); slow is slower than computing."""
    fast = script("fast", Behaviour(tokens=64))
    slow = script("slow", Behaviour(tokens=200))
    h = harness(fastest(native("fast", expect_read=FAST), native("slow", expect_read=SLOW)))
    frozen(h)
    req = h.add_request(prompt(200, 2), max_tokens=2)
    h.run_until_idle()
    assert allocs(fast, req.request_id) == [64]
    assert allocs(slow, req.request_id) == [0]
    assert counters(h)["plans.load"] == 1
    h.assert_clean()


def test_a_segment_is_cut_back_so_a_later_child_can_start_on_its_alignment(harness):
    """fast holds 70, slow 160; slow reads faster than the engine computes, fast faster
    still: fast loads [0, 64), slow [64, 160) (asked again at 64), the rest is computed."""
    fast = script("fast", Behaviour(tokens=70))
    slow = script("slow", Behaviour(tokens=160))
    medium = {"latency_ms": 0.0, "gbps": 0.001}
    h = harness(
        fastest(native("fast", expect_read=FAST), native("slow", expect_read=medium), prefill=50)
    )
    frozen(h)
    req = h.add_request(prompt(200, 3), max_tokens=2)
    h.run_until_idle()
    assert allocs(fast, req.request_id) == [64]
    assert allocs(slow, req.request_id) == [96]
    assert lookups_at(slow, req.request_id)[-1] == 64
    assert counters(h)["plans.stitch"] == 1
    h.assert_clean()


def test_measured_loads_replace_the_prior(harness):
    """a's prior says it is fast; its loads take 2 s each (the injected clock moves while
    it loads): from its first timed load on, fastest recomputes instead. (A child is
    measured only when it loads: a prior too slow is corrected only by setting it;
    docs/concepts.md.)"""
    a = script("a", Behaviour(tokens=160))
    h = harness(fastest(native("a", expect_read=FAST)), layer_calls=False)
    loads_take(h, frozen(h), 2.0)
    told = told_for(h, a, [prompt(200, 10 + seed) for seed in range(6)])
    costs = h.connector.scheduler_side.costs
    estimate = costs.loads[0]
    assert told[0] == 160 and told[-1] == 0, told
    assert estimate.measured == told.count(160)
    assert estimate.predict(160) == pytest.approx(2.0)  # the timed loads, not the prior
    # the clock moved only inside loads: no step's prefill took time, so none was measured
    # (a 2 s stall over a step's 40 tokens is not a prefill of 20 tokens/s)
    assert costs.prefill_tokens_per_s == 2000.0 and costs.prefill_measured == 0
    h.assert_clean()


@pytest.mark.parametrize("prior", [None, FAST], ids=["cold", "prior-set"])
def test_a_cold_child_takes_one_load_until_it_is_timed(harness, prior):
    """a has no prior: the default says it is fast, but that is a guess, so of two requests
    looked up in one step only the first loads from it, and only 128 of its 160 tokens (a
    probe); once that load is timed, the next request loads all 160 (the second probe may
    take 512). With a prior set, both load all at once."""
    a = script("a", Behaviour(tokens=160))
    h = harness(fastest(native("a", expect_read=prior) if prior else native("a")))
    frozen(h)
    first, second = (h.add_request(prompt(200, 30 + i), max_tokens=1) for i in range(2))
    h.step()
    assert allocs(a, first.request_id) == ([128] if prior is None else [160])
    assert allocs(a, second.request_id) == ([0] if prior is None else [160])
    h.run_until_idle()
    third = h.add_request(prompt(200, 32), max_tokens=1)
    h.run_until_idle()
    assert allocs(a, third.request_id) == [160]
    assert h.connector.scheduler_side.costs.loads[0].measured == (2 if prior is None else 3)
    h.assert_clean()


@pytest.mark.parametrize(("probe_s", "second"), [(0.0, 704), (0.1, 208), (0.2, 416), (1.0, 0)])
def test_a_probe_that_beats_computing_ends_the_probing(harness, probe_s, second):
    """a is cold and holds 704 tokens. Its first probe (128 tokens, priced at nothing) takes
    ``probe_s``: at 0 s it beats computing (2,000 tokens/s) even read as all rate, so the next
    request loads all 704. At 0.1 s (1,280 tokens/s read as rate) a is still cold; the line
    that time fitted (99.7 ms + the prior's 488,281 tokens/s: the test model's KV is 2 KiB a
    token) beats computing beyond 200 tokens, so the second probe is the shortest load past
    that on the 16-token grid, 208 (before, always 512: 4x the first); at 0.2 s (199.7 ms +
    the same rate) beyond 401: 416. At 1 s that line loses to computing at any length up to
    the cap (512), so a slow first probe ends the probing: the next request recomputes."""
    a = script("a", Behaviour(tokens=704))
    h = harness(fastest(native("a")), layer_calls=False)
    loads_take(h, frozen(h), probe_s)
    assert told_for(h, a, [prompt(800, 40 + seed) for seed in range(2)]) == [128, second]
    h.assert_clean()


def test_loads_queued_on_one_child_send_later_requests_to_another(harness):
    """Three requests looked up in one step, two async children: a (50 ms a load) and b
    (80 ms). The second request would wait behind the first's load on a, so it goes to b;
    the third to a again (100 ms behind a's queue beats 160 ms behind b's)."""
    a = script("a", Behaviour(tokens=160, is_async=True, load_steps=3))
    b = script("b", Behaviour(tokens=160, is_async=True, load_steps=3))
    read = {"gbps": 1000.0}
    h = harness(
        fastest(
            native("a", expect_read={"latency_ms": 50.0, **read}),
            native("b", expect_read={"latency_ms": 80.0, **read}),
            prefill=100,
        )
    )
    frozen(h)
    reqs = [h.add_request(prompt(200, 20 + i), max_tokens=1) for i in range(3)]
    h.step()
    owners = [
        "a" if allocs(a, r.request_id)[:1] == [160] else "b" if allocs(b, r.request_id) else "-"
        for r in reqs
    ]
    assert owners == ["a", "b", "a"]
    h.run_until_idle()
    assert not h.connector.scheduler_side.costs.expected  # every load was timed
    h.assert_clean()


def test_several_ranks_times_combine_to_the_slowest():
    """A load is done when every rank has it: vLLM's aggregator keeps the slowest time."""
    one = ComposedWorkerMeta((None,), {}, {("r", 0): 0.2, ("s", 1): 0.5})
    two = ComposedWorkerMeta((None,), {}, {("r", 0): 0.3})
    merged = one.aggregate(two)
    assert merged.load_seconds == {("r", 0): 0.3, ("s", 1): 0.5}


@pytest.mark.parametrize("policy", ["longest", "stitch"])
def test_the_other_policies_load_the_slow_child_regardless(harness, policy):
    """What fastest changes: longest and stitch load from a child however slow it is."""
    slow = script("slow", Behaviour(tokens=160))
    h = harness(kvcompose_config(chain("root", native("slow", expect_read=SLOW), policy=policy)))
    req = h.add_request(prompt(200, 4), max_tokens=2)
    h.run_until_idle()
    assert allocs(slow, req.request_id) == [160]
    h.assert_clean()


def test_the_engines_prefill_speed_is_measured_from_its_steps():
    """Each step's scheduled tokens over the time to the next step: a prefill step of 400
    tokens that took 2 s moves the 2,000 tokens/s prior halfway to 200; decode steps (fewer
    than MIN_PREFILL_STEP_TOKENS) measure nothing."""
    from kvcompose.composite.policies.fastest.costs import Costs, LoadCost

    clock = Clock()
    costs = Costs([LoadCost(0.001, 1e6)], 2000.0, clock)
    costs.step(400)
    clock.t += 2.0
    costs.step(1)  # the 400-token step took 2 s
    assert costs.prefill_tokens_per_s == pytest.approx(1100.0)
    clock.t += 5.0
    costs.step(400)  # a decode step (1 token) measures nothing
    assert costs.prefill_measured == 1
    for _ in range(30):
        clock.t += 2.0
        costs.step(400)
    assert costs.prefill_tokens_per_s == pytest.approx(200.0, rel=0.01)


def test_the_debug_decision_log_lists_every_plan_weighed(harness, caplog):
    """Issue 27 item 5: at debug level the decision line lists every plan weighed with its
    predicted time, then the chosen plan (the list is built only then: without debug the
    lookup takes the fast path, which builds none)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="kvcompose")
    script("fast", Behaviour(tokens=64))
    script("slow", Behaviour(tokens=200))
    h = harness(fastest(native("fast", expect_read=FAST), native("slow", expect_read=SLOW)))
    frozen(h)
    assert h.connector.scheduler_side.lookup._fast_asks is None  # debug: the general path
    req = h.add_request(prompt(200, 5), max_tokens=1)
    h.run_until_idle()
    lines = [r.getMessage() for r in caplog.records if req.request_id in r.getMessage()]
    decision = next(line for line in lines if "plans: " in line)
    weighed = decision.split("plans: ")[1].split("]")[0].split("; ")
    assert [w.rsplit(" ", 2)[0] for w in weighed] == [
        "recompute",
        "fast[0,64)",
        "fast[0,64) + slow[64,199)",
        "slow[0,199)",
    ], decision
    assert all(w.endswith(" ms") for w in weighed)
    assert "→ owner fast, 64 tokens" in decision
    h.assert_clean()


def test_a_cold_child_is_probed_in_a_stitch_then_stitched_whole(harness):
    """The fleet benchmark's trees:
    ``local`` is cold (no ``expect_read``, a prefix store) and holds 160 tokens, ``shared``
    is warm and async (20 ms + 0.5 GB/s, slower a token than local's default prior) and
    holds 320. Local enters a plan only as a 128-token probe; priced at its prior
    (1 ms + 1 GB/s) the probe stitch ``local[0,128) + shared[128,320)`` loses to
    ``shared[0,320)`` by about 1 ms, so local would never be loaded, never timed, and stay
    cold. A first probe is priced at nothing, so the first request stitches it; the probe
    is timed fast (the injected clock does not move), local is warm, and the next request
    stitches local's whole hit: ``local[0,160) + shared[160,320)``."""
    local = script("local", Behaviour(tokens=160))
    shared = script("shared", Behaviour(tokens=320, is_async=True, load_steps=2))
    h = harness(
        fastest(
            native("local"),
            native("shared", expect_read={"latency_ms": 20.0, "gbps": 0.5}),
        ),
        layer_calls=False,
    )
    loads_take(h, frozen(h), 0.0)
    costs = h.connector.scheduler_side.costs
    assert costs.cold(0) and not costs.cold(1)
    first = h.add_request(prompt(400, 50), max_tokens=1)
    h.run_until_idle()
    # (an async plan is allocated twice: its tokens, then 0 once they are received)
    assert allocs(local, first.request_id)[0] == 128
    assert allocs(shared, first.request_id)[0] == 192
    assert lookups_at(shared, first.request_id)[-1] == 128
    assert costs.loads[0].measured == 1 and not costs.cold(0)  # the probe was timed: fast
    second = h.add_request(prompt(400, 51), max_tokens=1)
    h.run_until_idle()
    assert allocs(local, second.request_id)[0] == 160
    assert allocs(shared, second.request_id)[0] == 160
    assert lookups_at(shared, second.request_id)[-1] == 160
    assert counters(h)["plans.stitch"] == 2
    assert not costs.expected  # every load was timed
    h.assert_clean()


def test_a_cold_childs_failed_probe_does_not_close_it_to_the_next_request(harness):
    """b (warm, sync) holds every prompt's first 48 tokens, a (cold, async) its first 160: the
    plan is ``b[0,48) + a[48,160)``, a's segment a probe. r1's fails; no other child holds
    those tokens, so the node gives them up and vLLM recomputes them: r1 goes on, decoding,
    without a new lookup. A failed load is never timed, so its wait ends with the stitch's
    receive, and r2, looked up while r1 still runs, is probed from a. Awaiting r1's time
    until r1 finished kept a closed to every other request (a cold child takes one load at
    a time): r2 loaded b's 48 tokens alone."""
    a = script(
        "a",
        Behaviour(tokens=160, is_async=True),
        r1=Behaviour(tokens=160, is_async=True, load="fail"),
    )
    b = script("b", Behaviour(tokens=48))
    h = harness(
        fastest(native("b", expect_read=FAST), native("a")), kv_load_failure_policy="recompute"
    )
    frozen(h)
    costs = h.connector.scheduler_side.costs
    h.add_request(prompt(200, 60), max_tokens=20, request_id="r1")
    for _ in range(6):
        h.step()
    assert allocs(b, "r1")[0] == 48 and allocs(a, "r1")[0] == 112  # a probe of 112 tokens
    assert receives(h, "r1") == 1 and counters(h)["lookups"] == 1  # failed, not looked up again
    assert not h.requests["r1"].is_finished() and costs.cold(1)
    assert not costs.expected  # the failed load awaits no time
    h.add_request(prompt(200, 61), max_tokens=1, request_id="r2")
    h.step()
    assert allocs(a, "r2")[:1] == [112]  # a is probed again, while r1 still runs
    assert not h.requests["r1"].is_finished()
    h.run_until_idle()
    assert costs.loads[1].measured == 1 and not costs.expected
    h.assert_clean()


def _answers_of(h: Any, req_id: str) -> list[tuple[int | None, bool]]:
    """Record every answer the node gives vLLM for ``req_id`` (what the scheduler is told)."""
    lookup = h.connector.scheduler_side.lookup
    answers: list[tuple[int | None, bool]] = []
    answer = lookup.answer

    def recorded(request: Any, local: int) -> tuple[int | None, bool]:
        out = answer(request, local)
        if request.request_id == req_id:
            answers.append(out)
        return out

    lookup.answer = recorded
    return answers


def _full_cache(harness: Any) -> Any:
    """a (async, 50 ms) and b (sync, 0 ms) under ``fastest``, computing 1,000 tokens/s, in a
    KV cache of 19 usable blocks of 16 tokens: a 200-token prompt takes 13, so a second one
    waits for the first to finish, its allocation failing each step (``Scheduler.schedule``:
    ``allocate_slots`` returns None, the request stays waiting and is looked up again in the
    next step)."""
    read = {"gbps": 1000.0}
    a = native("a", expect_read={"latency_ms": 50.0, **read})
    b = native("b", expect_read={"latency_ms": 0.0, **read})
    h = harness(fastest(a, b, prefill=1000.0), num_blocks=20)
    frozen(h)
    return h


def _r2_waits_for_r1(h: Any, seed: int) -> list[tuple[int | None, bool]]:
    """r1 (200 tokens, 5 out) takes the cache, then r2 (200 tokens) waits for it, looked up
    each step; runs to the end and returns the node's answers for r2."""
    answers = _answers_of(h, "r2")
    h.add_request(prompt(200, seed), max_tokens=5, request_id="r1")
    h.step()
    h.add_request(prompt(200, seed + 1), max_tokens=1, request_id="r2")
    h.run_until_idle()
    return answers


def test_a_request_whose_allocation_fails_gets_the_same_plan_each_step(harness):
    """a (async, 50 ms) holds 160 tokens, b (sync, 0 ms) 64; computing runs 1,000 tokens/s:
    a's 160 tokens (50 ms, then 40 computed) beat b's 64 (136 computed). r2's allocation fails
    while r1 holds the cache; each step vLLM asks again. Its own planned load on a never
    started, so it is no queue in front of itself: every answer is a's, and a loads once.
    Priced with that phantom queue, the answers flipped between a's and b's plan, and the
    last one before the allocation (b's) won."""
    a = script("a", Behaviour(tokens=160, is_async=True), r1=Behaviour())
    b = script("b", Behaviour(tokens=64), r1=Behaviour())
    h = _full_cache(harness)
    answers = _r2_waits_for_r1(h, 70)
    assert len(answers) >= 3  # looked up again while r1 held the cache
    assert set(answers) == {(160, True)}
    assert allocs(a, "r2") == [160, 0] and set(allocs(b, "r2")) == {0}
    totals = counters(h)
    assert totals["lookups"] == 2  # r1's miss and r2's plan, once
    assert totals["lookup_repeats"] == len(answers) - 1
    assert totals["plans.load"] == 1 and totals["hits.a"] == 1
    assert not h.connector.scheduler_side.costs.expected
    h.assert_clean()


def test_a_waiting_request_is_still_steered_away_from_another_requests_load(harness):
    """The children of the test above; r1's load on a is in flight (three worker steps) and
    holds the cache. r2, waiting for blocks, is priced behind r1's load on a (50 ms left):
    b's plan, every step until r1's load is timed. Only a request's own unstarted plan is
    left out of its price."""
    a = script("a", Behaviour(tokens=160, is_async=True, load_steps=3))
    b = script("b", Behaviour(tokens=64))
    h = _full_cache(harness)
    answers = _answers_of(h, "r2")
    h.add_request(prompt(200, 74), max_tokens=5, request_id="r1")
    h.step()
    assert allocs(a, "r1") == [160]
    h.add_request(prompt(200, 75), max_tokens=1, request_id="r2")
    h.step()
    h.step()
    assert answers == [(64, False), (64, False)]  # behind r1's load on a, twice
    assert allocs(b, "r2") == [] and counters(h)["lookup_repeats"] == 1
    h.run_until_idle()
    h.assert_clean()


@pytest.mark.parametrize("policy", ["longest", "stitch"])
def test_a_repeated_lookup_is_counted_as_a_repeat(harness, policy):
    """A lookup vLLM repeats because the allocation failed counts once as a lookup and a
    hit: the repeats are counted as such (longest and stitch, as fastest above)."""
    a = script("a", Behaviour(tokens=160), r1=Behaviour())
    tree = chain("root", native("a"), policy=policy)
    h = harness(kvcompose_config(tree), num_blocks=20)
    answers = _r2_waits_for_r1(h, 72)
    assert len(answers) >= 3 and set(answers) == {(160, False)}
    assert allocs(a, "r2") == [160]
    totals = counters(h)
    assert totals["lookups"] == 2  # r1's miss and r2's plan
    assert totals["lookup_repeats"] == len(answers) - 1
    assert totals["hits.a"] == 1 and totals["hit_tokens.a"] == 160
    h.assert_clean()


def test_a_repeated_lookup_keeps_the_deadline_it_passed(harness):
    """a never answers r2 (``None``); at the node's deadline b's 160 tokens are taken. r2's
    allocation then fails while r1 holds the cache, and vLLM asks again each step: the
    deadline a missed still stands, so every answer is b's. Restarting the clock at each
    decision answered ``None`` and b's in turn."""
    script("a", Behaviour(), r2=Behaviour(pending_lookups=1000))
    b = script("b", Behaviour(tokens=160), r1=Behaviour())
    tree = chain("root", native("a"), native("b"), policy="longest", lookup_timeout_s=1e-9)
    h = harness(kvcompose_config(tree), num_blocks=20)
    answers = _r2_waits_for_r1(h, 76)
    assert answers[0] == (None, False) and len(answers) >= 4
    assert set(answers[1:]) == {(160, False)}
    assert allocs(b, "r2") == [160]
    h.assert_clean()
