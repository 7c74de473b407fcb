"""The scheduler half's per-request fast paths keep the general rule's answers, on vLLM's real
scheduler: children that inherit a method from vLLM's ``KVConnectorBase_V1`` are not called for
it (the base's answer is known and changes nothing), the lookup fast path checks every answer
a child has not given before (the guard still sees every malformed one), and it yields to the
general rule for a child taken out of lookups."""

from __future__ import annotations

import random

import pytest
from vllm.v1.request import RequestStatus

from kvcompose.composite.children import inherits_base
from kvcompose.testing.noop import MODULE_PATH, NoopConnector
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt


def noop_leaf(name: str) -> dict:
    return {"kind": "leaf", "name": name, "connector": "NoopConnector", "module_path": MODULE_PATH}


def test_only_children_that_implement_a_base_method_are_called_for_it(harness):
    s = script("s", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", noop_leaf("n0"), leaf("s"), noop_leaf("n1"))))
    children = h.connector.children
    noop = children.connectors[0]
    assert isinstance(noop, NoopConnector)
    assert inherits_base(noop, "on_new_request") and inherits_base(noop, "take_events")
    assert not inherits_base(noop, "request_finished")  # NoopConnector writes its own
    # the scripted child writes update_connector_output; no child writes take_events
    assert children.implementing("update_connector_output") == (1,)
    assert children.implementing("take_events") == ()
    assert children.implementing("request_finished") == (0, 1, 2)

    calls: list[str] = []

    def on_new_request(request):  # replaced on the instance: now n1 implements it
        calls.append(request.request_id)

    children.connectors[2].on_new_request = on_new_request
    h.connector.refresh_child_methods()
    assert children.implementing("on_new_request") == (2,)
    req = h.add_request(prompt(80), max_tokens=2)
    h.run_until_idle()
    assert calls == [req.request_id]
    assert s.finished[req.request_id] == 1
    assert h.connector.get_kv_connector_stats() is None  # drained above, nothing since
    h.assert_clean()


def test_a_repeated_malformed_answer_is_a_violation_every_time(harness):
    """The fast lookup skips the checks only for the very ``(0, False)`` tuple a child gave
    before; ``(0, True)`` (a constant in the scripted child) is normalised every time."""
    script("a", Behaviour(break_zero_async=True))
    b = script("b", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    reqs = [h.add_request(prompt(40, seed), max_tokens=1) for seed in range(3)]
    h.run_until_idle()
    assert h.connector.guard.violations[("a", "zero_async")] == 3
    assert all(b.lookups(r.request_id) == 1 for r in reqs)  # a's (0, True) is a miss
    h.assert_clean()


def test_a_child_that_missed_before_still_owns_its_hit(harness):
    a = script("a", Behaviour())
    script("b", Behaviour(tokens=48))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    earlier = [h.add_request(prompt(40, seed), max_tokens=1) for seed in range(2)]
    h.run_until_idle()  # a missed them all (b loaded them)
    hit = h.add_request(prompt(80, 9), max_tokens=3)
    a.per_request[hit.request_id] = Behaviour(tokens=64)
    h.step()
    assert h.connector.ownership()[hit.request_id]["owner"] == "a"
    h.run_until_idle()
    assert h.connector.stats_totals()["counters"]["lookups"] == len(earlier) + 1
    h.assert_clean()


def _random_behaviour(rng, prompt_len: int) -> Behaviour:
    """One child's answer, drawn from everything a lookup can return: a miss, a hit (sync or
    async, the whole prompt included), ``None`` once, or a malformed ``(0, True)``."""
    kind = rng.random()
    if kind < 0.1:
        return Behaviour(pending_lookups=1)
    if kind < 0.2:
        return Behaviour(break_zero_async=True)
    tokens = rng.choice([0, 0, 16, 32, 48, prompt_len - 1, prompt_len])
    return Behaviour(
        tokens=tokens, is_async=rng.random() < 0.4, break_whole_prompt=rng.random() < 0.3
    )


#: ``fastest``'s children: native (so stitches are weighed), priors a little slower and
#: faster than the engine's 2,000 tokens/s with and without latency, so that recompute, loads
#: and stitches all win some draws.
FASTEST_PRIORS = (
    {"latency_ms": 0.0, "gbps": 0.0001},
    {"latency_ms": 5.0, "gbps": 1000.0},
    {"latency_ms": 0.0, "gbps": 1000.0},
)


@pytest.mark.parametrize("policy", ["first", "longest", "fastest"])
def test_the_fast_lookup_answers_as_the_general_rule(harness, policy):
    """The unrolled common case (``Lookup.answer``; ``fastest``'s own) and the general rule
    (``Lookup.decide``, through ``plan``) give the same answer and record the same owner (and
    segments, and loads awaiting their time) for the same children's answers, over 300 random
    draws (each draw asks two request ids, one on each path)."""
    rng = random.Random(20261202)
    names = ("a", "b", "c")
    scripts = [script(n, Behaviour()) for n in names]
    if policy == "fastest":
        leaves = [
            leaf(n, load_range="native", expect_read=p)
            for n, p in zip(names, FASTEST_PRIORS, strict=True)
        ]
    else:
        leaves = [leaf(n) for n in names]
    h = harness(kvcompose_config(chain("root", *leaves, policy=policy)))
    side = h.connector.scheduler_side
    lookup = side.lookup
    for draw in range(300):
        prompt_len = rng.choice([40, 64, 80])
        local = rng.choice([0, 0, 16])
        tokens = h.make_prompt(prompt_len, seed=draw)
        fast, general = f"fast-{draw}", f"general-{draw}"
        for s in scripts:
            s.per_request[fast] = s.per_request[general] = _random_behaviour(rng, prompt_len)
        answers = []
        for req_id in (fast, general):
            request = h.add_request(tokens, request_id=req_id, max_tokens=1)
            h.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
            if req_id == fast:
                assert lookup._fast_asks is not None  # the fast path is taken
                answer = lookup.answer(request, local)
            else:
                answer = lookup.decide(request, local, None)
            record = side.ledger.finished(req_id)
            segments = (
                () if record is None else [(g.child, g.start, g.end) for g in record.segments]
            )
            expected = None
            if side.costs is not None:  # fastest: the loads awaiting their time, then none
                expected = sorted(
                    (c, e.tokens) for (r, c), e in side.costs.expected.items() if r == req_id
                )
                side.costs.forget(req_id)
            answers.append(
                (
                    answer,
                    None if record is None else (record.owner, record.tokens),
                    segments,
                    expected,
                )
            )
        assert answers[0] == answers[1], f"draw {draw}: {[s.per_request[fast] for s in scripts]}"
        if answers[0][0][0] and not answers[0][0][1]:
            assert local + answers[0][0][0] < prompt_len  # a sync load leaves a token
        side.guard.lookup_errors.clear()
    if policy == "fastest":  # every kind of plan was chosen (each draw counts twice)
        plans = h.connector.stats_totals()["counters"]
        kinds = {k: v for k, v in plans.items() if k.startswith("plans.")}
        assert kinds["plans.recompute"] >= 20 and kinds["plans.load"] >= 20, kinds
        assert kinds["plans.stitch"] >= 8, kinds
