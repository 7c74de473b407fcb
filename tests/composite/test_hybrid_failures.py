"""Load failures on a model with several KV cache groups, on vLLM's real scheduler.

The harness makes the tiny model hybrid (``sliding_window``): a sliding-window group and a
full-attention group, each with its own block ids. vLLM's ``Scheduler._handle_invalid_blocks``
raises (the engine dies) on any invalid block id there: block ids are unique only within a
group. A node under several groups reports a failed load by request (``failed_recving``) and
never by block, so it reports every sync load of a child that can be parked as async (vLLM
parks the request for one step while the child loads): a failed one can then be reported.
A sync hit of a child that cannot be parked is not taken.

Each scenario also runs with one group (the plain harness), where the node behaves as it
always did: sync loads stay sync, failures go up as invalid blocks.
"""

from __future__ import annotations

from typing import Any

import pytest
from stitch_helpers import BLOCK, allocs, lookups_at, receives, scheduled
from stitch_helpers import stitch_config as stitch

from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

PROMPT = 100
WINDOW = 2 * BLOCK
#: A pool in which one 200-token request on the two groups leaves too few blocks for another.
REPEAT_BLOCKS = 30


def hma(name: str, **fields: Any) -> dict[str, Any]:
    """A scripted leaf that supports HMA and can be parked (``native``)."""
    return leaf(name, connector="ScriptedHMAConnector", load_range="native", **fields)


def hybrid_harness(harness, config: dict[str, Any], groups: int, **kw: Any):
    """A harness over ``KVComposeHMA`` with ``groups`` KV cache groups (1: the plain model)."""
    config = {**config, "kv_connector": "KVComposeHMA"}
    kw.setdefault("kv_load_failure_policy", "recompute")
    if groups == 2:
        kw.update(num_blocks=256, sliding_window=WINDOW)
    h = harness(config, **kw)
    assert len(h.kv_cache_config.kv_cache_groups) == groups
    return h


def outputs(h) -> list[Any]:
    """The connector outputs vLLM's scheduler read (a step that ran no batch has none)."""
    return [r.kv_connector_output for r in h.history if r.kv_connector_output is not None]


def invalid_blocks_sent(h) -> list[int]:
    return sorted(b for out in outputs(h) for b in (out.invalid_block_ids or ()))


def failed_sent(h, req_id: str) -> int:
    return sum(req_id in (out.failed_recving or ()) for out in outputs(h))


def counters(h) -> dict[str, int]:
    return h.connector.stats_totals()["counters"]


# --------------------------------------------------------------------------- the harness


def test_the_harness_forms_a_sliding_and_a_full_group(harness):
    script("a", Behaviour(tokens=64))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), 2)
    kinds = [type(g.kv_cache_spec).__name__ for g in h.kv_cache_config.kv_cache_groups]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]
    rid = h.add_request(prompt(PROMPT), max_tokens=3).request_id
    while rid not in h.step().scheduled:  # parked while a loads (see below)
        pass
    sliding, full = h.scheduler.kv_cache_manager.get_block_ids(rid)
    assert len(full) == -(-PROMPT // BLOCK) and 0 not in full
    assert 0 in sliding, "the blocks before the window are the null block"
    h.run_until_idle()
    h.assert_clean()


def test_the_harness_keeps_one_group_by_default(harness):
    script("a", Behaviour(tokens=64))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    assert len(h.kv_cache_config.kv_cache_groups) == 1


# ------------------------------------------------------------------- a child that raises


@pytest.mark.parametrize("groups", [1, 2])
def test_a_sync_child_raising_in_start_load_kv_is_recomputed(harness, groups):
    a = script("a", Behaviour(tokens=64, raise_in=frozenset({"start_load_kv"})))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), groups)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in a.calls
    assert h.finished[rid].finish_reason.name == "LENGTH"
    assert len(h.finished[rid].output_token_ids) == 2
    if groups == 1:
        # by block, as always: the step computed its tokens over the bad blocks, and vLLM
        # recomputes them with the rest
        assert scheduled(h, rid) == (PROMPT - 64) + PROMPT + 1
        assert invalid_blocks_sent(h)
        assert failed_sent(h, rid) == 0 and receives(h, rid) == 0
    else:
        assert scheduled(h, rid) == PROMPT + 1, "nothing computed over bad KV"
        assert not invalid_blocks_sent(h)
        assert failed_sent(h, rid) == 1 and receives(h, rid) == 1
        assert a.lookups(rid) == 1, "excluded once its load failed"
    h.assert_clean()


@pytest.mark.parametrize("groups", [1, 2])
def test_a_sync_child_raising_falls_back_to_the_next_child(harness, groups):
    """a's sync load raises; b, the next child, holds less and serves the request: while
    parked (2 groups: it reloads the range a lost, in the recovery round), or after vLLM's
    recompute of the failed blocks (1 group: b is not asked again, the request is running)."""
    a = script("a", Behaviour(tokens=64, raise_in=frozenset({"start_load_kv"})))
    b = script("b", Behaviour(tokens=48))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"), hma("b"))), groups)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in a.calls
    assert h.finished[rid].finish_reason.name == "LENGTH"
    if groups == 2:
        assert not invalid_blocks_sent(h)
        assert allocs(b, rid)[1] == 48, "b loads what it holds of a's range"
        assert b.lookups(rid) >= 1
    h.assert_clean()


@pytest.mark.parametrize("groups", [1, 2])
def test_an_async_child_raising_in_start_load_kv_is_recomputed(harness, groups):
    """Contained before this change too: an async load fails by request on any model."""
    a = script("a", Behaviour(tokens=64, is_async=True, raise_in=frozenset({"start_load_kv"})))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), groups)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in a.calls
    assert h.finished[rid].finish_reason.name == "LENGTH"
    assert scheduled(h, rid) == PROMPT + 1
    assert failed_sent(h, rid) == 1 and not invalid_blocks_sent(h)
    h.assert_clean()


def test_a_sync_failure_under_the_fail_policy_fails_the_request_only(harness):
    raising = Behaviour(tokens=64, raise_in=frozenset({"start_load_kv"}))
    script("a", Behaviour(tokens=64), bad=raising)
    h = hybrid_harness(
        harness,
        kvcompose_config(chain("root", hma("a"))),
        2,
        kv_load_failure_policy="fail",
    )
    bad = h.add_request(prompt(PROMPT), max_tokens=2, request_id="bad").request_id
    h.run_until_idle()
    assert h.finished[bad].finish_reason.name == "ERROR"
    assert not invalid_blocks_sent(h)
    # the scheduler goes on: the next request loads from a
    good = h.add_request(prompt(PROMPT, seed=1), max_tokens=2, request_id="good").request_id
    h.run_until_idle()
    assert h.finished[good].finish_reason.name == "LENGTH"
    assert scheduled(h, good) == PROMPT - 64 + 1
    h.assert_clean()


# ------------------------------------------------------------- a child's own bad blocks


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_childs_bad_blocks_fail_its_load_by_request(harness, is_async):
    """A child that names bad blocks (a failed read, as a store reports one): on 2 groups
    its load fails by request and the request is recomputed."""
    script("a", Behaviour(tokens=64, is_async=is_async, load="invalid", invalid_block=1))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert h.finished[rid].finish_reason.name == "LENGTH"
    assert not invalid_blocks_sent(h)
    assert failed_sent(h, rid) == 1
    assert scheduled(h, rid) == PROMPT + 1
    h.assert_clean()


# ------------------------------------------------------------------ stitched segments


@pytest.mark.parametrize("groups", [1, 2])
def test_a_failed_sync_stitched_segment(harness, groups):
    """a [0, 32) and b [32, 80), both sync; b raises. One group: a's range survives (b's
    blocks are invalid, vLLM recomputes from 32). Two groups: the stitch is parked; with no
    child to reload b's range the request fails by request and is looked up again without
    b: a's range is loaded again."""
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=80, raise_in=frozenset({"start_load_kv"})))
    h = hybrid_harness(harness, stitch(hma("a"), hma("b")), groups)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in b.calls
    assert h.finished[rid].finish_reason.name == "LENGTH"
    if groups == 1:
        assert invalid_blocks_sent(h)
        # a's range kept; the step's tokens computed over b's bad blocks are recomputed
        assert scheduled(h, rid) == (PROMPT - 80) + (PROMPT - 32) + 1
    else:
        assert not invalid_blocks_sent(h) and failed_sent(h, rid) == 1
        assert lookups_at(b, rid) == [32], "b excluded after its failure"
        assert allocs(a, rid)[0] == 32 and 32 in allocs(a, rid)[1:], "a loads again"
        assert scheduled(h, rid) == PROMPT - 32 + 1
    h.assert_clean()


def test_a_failed_sync_stitched_segment_is_reloaded_on_two_groups(harness):
    """b's range [32, 80) fails; c holds it whole and reloads it while the request is
    parked: nothing is lost, vLLM sees one receive."""
    script("a", Behaviour(tokens=32))
    script("b", Behaviour(tokens=80, raise_in=frozenset({"start_load_kv"})))
    c = script("c", Behaviour(tokens=80))
    h = hybrid_harness(harness, stitch(hma("a"), hma("b"), hma("c")), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert not invalid_blocks_sent(h) and failed_sent(h, rid) == 0
    assert 48 in allocs(c, rid), "c reloads b's range"
    assert receives(h, rid) == 1
    assert scheduled(h, rid) == PROMPT - 80 + 1
    h.assert_clean()


def test_a_failed_async_stitched_segment_fails_by_request_on_two_groups(harness):
    script("a", Behaviour(tokens=32, is_async=True))
    b = script("b", Behaviour(tokens=80, is_async=True, load="fail"))
    h = hybrid_harness(harness, stitch(hma("a"), hma("b")), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert b.recv_reports(rid) == [True]
    assert not invalid_blocks_sent(h) and failed_sent(h, rid) == 1
    assert scheduled(h, rid) == PROMPT - 32 + 1
    h.assert_clean()


# ------------------------------------------------------------ what cannot be parked


def test_a_sync_hit_of_a_child_that_cannot_be_parked_is_not_taken_on_two_groups(harness):
    """A child kvcompose does not know (``sole_owner``) may load only what vLLM schedules:
    it cannot be parked, so its sync hit is not taken (a failure could not be reported)."""
    a = script("a", Behaviour(tokens=64))
    h = hybrid_harness(
        harness,
        kvcompose_config(chain("root", leaf("a", connector="ScriptedHMAConnector"))),
        2,
    )
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(a, rid) == [0]
    assert scheduled(h, rid) == PROMPT + 1
    assert counters(h)["not_parked.a"] == 1
    h.assert_clean()


@pytest.mark.parametrize("policy", ["first", "longest", "stitch", "fastest"])
def test_a_parkable_childs_hit_is_taken_over_one_that_cannot_be_parked(harness, policy):
    """a (``sole_owner``: cannot be parked) holds 64 tokens, b (``native``) 48, both sync and
    fast to load. On two groups a's sync hit is skipped while planning, as if it missed, so
    every policy takes b's: parked, loaded in the step vLLM holds the request. Planned first
    and refused after, a's hit left the whole prompt to compute."""
    a = script("a", Behaviour(tokens=64))
    b = script("b", Behaviour(tokens=48))
    fast = {"latency_ms": 0.0, "gbps": 1000.0}
    unparkable = leaf("a", connector="ScriptedHMAConnector", expect_read=fast)
    tree = chain("root", unparkable, hma("b", expect_read=fast), policy=policy)
    tree["expect_prefill_tokens_per_s"] = 2000.0
    h = hybrid_harness(harness, kvcompose_config(tree), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert 64 not in allocs(a, rid)
    assert allocs(b, rid)[0] == 48
    assert receives(h, rid) == 1, "b's sync load parked"
    assert scheduled(h, rid) == PROMPT - 48 + 1
    totals = counters(h)
    assert totals["not_parked.a"] == 1 and totals["hits.b"] == 1 and "hits.a" not in totals
    h.assert_clean()


def test_a_parked_plan_asked_again_before_its_allocation_is_a_repeat(harness):
    """r1 takes the KV cache; r2's allocation fails each step while r1 runs, and vLLM asks
    again (``Scheduler.schedule`` keeps it waiting). r2's plan is a's sync load, parked (held
    as a one-segment stitch): each answer after the first repeats it and is counted as a
    repeat, not as a new lookup and hit."""
    a = script("a", Behaviour(tokens=160), r1=Behaviour())
    config = {**kvcompose_config(chain("root", hma("a"))), "kv_connector": "KVComposeHMA"}
    h = harness(
        config,
        num_blocks=REPEAT_BLOCKS,
        max_model_len=224,
        sliding_window=WINDOW,
        kv_load_failure_policy="recompute",
    )
    lookup = h.connector.scheduler_side.lookup
    answers: list[tuple[int | None, bool]] = []
    answer = lookup.answer

    def recorded(request: Any, local: int) -> tuple[int | None, bool]:
        out = answer(request, local)
        if request.request_id == "r2":
            answers.append(out)
        return out

    lookup.answer = recorded
    h.add_request(prompt(200, 80), max_tokens=5, request_id="r1")
    h.step()
    h.add_request(prompt(200, 81), max_tokens=1, request_id="r2")
    h.run_until_idle()
    assert len(answers) >= 3 and set(answers) == {(160, False)}, answers
    assert allocs(a, "r2")[0] == 160 and receives(h, "r2") == 1
    totals = counters(h)
    assert totals["lookups"] == 2  # r1's miss and r2's plan, once
    assert totals["lookup_repeats"] == len(answers) - 1
    assert totals["hits.a"] == 1 and totals["hit_tokens.a"] == 160
    h.assert_clean()


@pytest.mark.parametrize("groups", [1, 2])
def test_a_sync_load_that_succeeds(harness, groups):
    """Two groups: parked for one step (the cost of a failure being reportable), then the
    request computes what the child did not hold. One group: no step parked."""
    a = script("a", Behaviour(tokens=64))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), groups)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(a, rid)[0] == 64
    assert scheduled(h, rid) == PROMPT - 64 + 1
    assert receives(h, rid) == (1 if groups == 2 else 0)
    assert a.recv_reports(rid) == [], "the node reports the parked sync load's receive"
    h.assert_clean()


# ------------------------------------------------------------------ around the failure


def test_a_fallback_after_a_failed_async_load_is_parked_and_loads(harness):
    """a's async load fails; vLLM looks the request up again without a, and b's sync load
    (parked on 2 groups) serves it."""
    script("a", Behaviour(tokens=64, is_async=True, load="fail"))
    b = script("b", Behaviour(tokens=48))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"), hma("b"))), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert failed_sent(h, rid) == 1 and not invalid_blocks_sent(h)
    assert 48 in allocs(b, rid)
    assert receives(h, rid) == 2, "a's failed receive, then b's parked load's"
    assert scheduled(h, rid) == PROMPT - 48 + 1
    h.assert_clean()


def test_a_fallback_that_fails_too_leaves_the_request_to_recompute(harness):
    script("a", Behaviour(tokens=64, is_async=True, load="fail"))
    b = script("b", Behaviour(tokens=48, raise_in=frozenset({"start_load_kv"})))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"), hma("b"))), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in b.calls
    assert failed_sent(h, rid) == 2 and not invalid_blocks_sent(h)
    assert scheduled(h, rid) == PROMPT + 1
    assert h.finished[rid].finish_reason.name == "LENGTH"
    h.assert_clean()


def test_abort_while_a_failed_parked_load_awaits_its_recovery(harness):
    """a's parked sync load failed; the request is aborted before the next step gives it up:
    vLLM still gets the one receive that frees its blocks."""
    script("a", Behaviour(tokens=64, raise_in=frozenset({"start_load_kv"})))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()
    assert h.connector.ownership()[rid]["state"] == "recovering"
    h.abort(rid)
    h.run_until_idle()
    assert receives(h, rid) == 1 and not invalid_blocks_sent(h)
    h.assert_clean()


def test_a_nested_node_parks_its_own_sync_loads(harness):
    """The nested node parks its child's sync load and answers its parent async; the
    failure goes up by request through both."""
    a = script("a", Behaviour(tokens=64, raise_in=frozenset({"start_load_kv"})))
    b = script("b", Behaviour(tokens=32))
    inner = chain("inner", hma("a"))
    h = hybrid_harness(harness, kvcompose_config(chain("root", inner, hma("b"))), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert ("raise", "start_load_kv", rid) in a.calls
    assert failed_sent(h, rid) == 1 and not invalid_blocks_sent(h)
    assert allocs(b, rid)[-2:] == [32, 0], "b serves the request looked up again"
    assert scheduled(h, rid) == PROMPT - 32 + 1
    assert not h.connector.guard.violations and not h.worker_connector.guard.violations
    h.assert_clean()


def test_a_sync_load_failing_on_one_rank_fails_by_request(harness):
    """Two worker ranks: a names bad blocks on rank 1 only; the other rank's half loaded,
    but the request fails by request all the same."""
    rank1 = frozenset({1})
    script("a", Behaviour(tokens=64, load="invalid", invalid_block=2, fails_on_ranks=rank1))
    h = hybrid_harness(harness, kvcompose_config(chain("root", hma("a"))), 2, num_workers=2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert failed_sent(h, rid) == 1 and not invalid_blocks_sent(h)
    assert scheduled(h, rid) == PROMPT + 1
    h.assert_clean()


@pytest.mark.parametrize("fails", [False, True])
def test_parked_sync_loads_under_async_scheduling(tiny_model, fails):
    """The scheduler runs one batch ahead (``AsyncSchedulerHarness``): a parked sync load's
    receive, or its failure, still reaches vLLM by request."""
    from kvcompose.engine.harness import AsyncSchedulerHarness

    raise_in = frozenset({"start_load_kv"}) if fails else frozenset()
    script("a", Behaviour(tokens=64, raise_in=raise_in))
    config = {**kvcompose_config(chain("root", hma("a"))), "kv_connector": "KVComposeHMA"}
    h = AsyncSchedulerHarness(
        tiny_model,
        config,
        block_size=BLOCK,
        num_blocks=256,
        sliding_window=WINDOW,
        with_worker=True,
        kv_load_failure_policy="recompute",
    )
    try:
        rids = [h.add_request(prompt(PROMPT, seed=s), max_tokens=3).request_id for s in range(3)]
        h.run_until_idle()
        assert not invalid_blocks_sent(h)
        for rid in rids:
            assert h.finished[rid].finish_reason.name == "LENGTH"
            assert failed_sent(h, rid) == (1 if fails else 0)
        h.assert_clean()
    finally:
        h.close()


def test_a_grant_cut_inside_an_uncuttable_sync_segment_is_given_up_by_request(harness):
    """vLLM rounds the grant down to a block (bounded prefix replay) inside a sync segment
    that cannot be cut. On two groups the sync stitch is parked, so the lost range goes up by
    request (vLLM looks the request up again without the dropped child) instead of the grant
    being refused (``LedgerError``, which vLLM's scheduler would not survive)."""
    a = script("a", Behaviour(tokens=32))
    tail = script("tail", Behaviour(tokens=120, loads_unhashed=True))
    tail_leaf = leaf("tail", connector="ScriptedHMAConnector", load_range="last_segment")
    h = hybrid_harness(harness, stitch(hma("a"), tail_leaf), 2)
    h.scheduler.prefix_replay_tokens = BLOCK  # as vLLM sets it for such models
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert not invalid_blocks_sent(h) and failed_sent(h, rid) == 1
    assert tail.lookups(rid) == 1, "skipped on the re-lookup"
    assert set(allocs(tail, rid)) == {0}
    assert lookups_at(a, rid) == [0, 0]
    assert h.finished[rid].finish_reason.name == "LENGTH"
    h.assert_clean()


@pytest.mark.parametrize("fails", [False, True])
def test_fastest_parks_its_sync_plan_on_two_groups(harness, fails):
    """``policy: fastest`` chooses a's sync load (far faster than computing): parked on two
    groups; its failure goes up by request; no load's time is left awaited."""
    raise_in = frozenset({"start_load_kv"}) if fails else frozenset()
    a = script("a", Behaviour(tokens=64, raise_in=raise_in))
    tree = chain("root", hma("a", expect_read={"latency_ms": 0.0, "gbps": 1000.0}))
    tree.update(policy="fastest", expect_prefill_tokens_per_s=2000.0)
    h = hybrid_harness(harness, kvcompose_config(tree), 2)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(a, rid)[0] == 64
    assert not invalid_blocks_sent(h) and failed_sent(h, rid) == (1 if fails else 0)
    assert scheduled(h, rid) == (PROMPT if fails else PROMPT - 64) + 1
    assert h.connector.scheduler_side.costs.expected == {}
    h.assert_clean()
