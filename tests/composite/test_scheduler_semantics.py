"""The composite's semantics on vLLM's real scheduler, with scripted children.

Each scenario also names what upstream MultiConnector (or a naive composite) does, and where
upstream fails, a baseline test runs vLLM's own MultiConnector over the same children and shows
the failure.
"""

from __future__ import annotations

import pytest

from kvcompose.composite.guard import ContractViolation
from kvcompose.testing.scripted import Behaviour, direct, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, multiconnector_config, prompt

BLOCK = 16


def owner_of(h, req_id: str) -> dict:
    return h.connector.ownership()[req_id]


def ext_allocs(s, req_id):
    return [n for n, _ in s.allocations(req_id)]


# --------------------------------------------------------------------- ownership by policy
@pytest.mark.parametrize(("policy", "owner", "tokens"), [("first", "a", 32), ("longest", "b", 64)])
def test_policy_picks_owner_and_only_owner_is_told_n(harness, policy, owner, tokens):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=64))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"), policy=policy)))
    req = h.add_request(prompt(80), max_tokens=3)
    h.step()
    assert owner_of(h, req.request_id)["owner"] == owner
    assert owner_of(h, req.request_id)["tokens"] == tokens
    assert req.num_computed_tokens >= tokens
    told = {"a": ext_allocs(a, req.request_id), "b": ext_allocs(b, req.request_id)}
    assert told[owner] == [tokens]
    assert told["b" if owner == "a" else "a"] == [0]
    h.run_until_idle()
    assert a.finished[req.request_id] == 1 and b.finished[req.request_id] == 1
    h.assert_clean()


def test_longest_ties_go_to_the_earlier_child(harness):
    script("a", Behaviour(tokens=48))
    script("b", Behaviour(tokens=48))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"), policy="longest")))
    req = h.add_request(prompt(80))
    h.step()
    assert owner_of(h, req.request_id)["owner"] == "a"
    h.run_until_idle()
    h.assert_clean()


def test_first_does_not_ask_children_after_a_hit(harness):
    """Fewer side effects than upstream, which queries every child (W2)."""
    script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=64))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80))
    h.run_until_idle()
    assert b.lookups(req.request_id) == 0
    assert ext_allocs(b, req.request_id) == [0]  # ...but it still hears the allocation
    h.assert_clean()


# ------------------------------------------------------------------------- zero tokens
def test_every_child_hears_every_allocation_with_real_blocks_including_after_async(harness):
    a = script("a", Behaviour(tokens=48, is_async=True, load_steps=2))
    b = script("b", Behaviour())
    c = script("c", Behaviour(tokens=16))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"), leaf("c"))))
    req = h.add_request(prompt(70), max_tokens=2)
    h.run_until_idle()
    rid = req.request_id
    assert ext_allocs(a, rid) == [48, 0]  # the load, then the second pass after it
    assert ext_allocs(b, rid) == [0, 0]
    assert ext_allocs(c, rid) == [0, 0]
    for s in (a, b, c):
        first_blocks = s.allocations(rid)[0][1]
        assert len(first_blocks) >= 48 // BLOCK, "non-owners must get the real blocks"
    h.assert_clean()


def test_scheduler_trimming_to_zero_reaches_the_owner_as_zero(harness):
    """A local prefix hit covering the owner's offer: vLLM passes 0, the owner hears 0."""
    a = script("a", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    first = h.add_request(prompt(80), max_tokens=1)
    h.run_until_idle()
    # the same prompt again: the local prefix cache now covers more than a's 32 tokens
    again = h.add_request(prompt(80), max_tokens=1)
    h.run_until_idle()
    assert ext_allocs(a, first.request_id) == [32]
    assert ext_allocs(a, again.request_id) == [0]
    h.assert_clean()


# ---------------------------------------------------------------------- contract guard
def test_zero_async_is_normalised_and_counted(harness):
    script("a", Behaviour(break_zero_async=True))
    script("b", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80))
    h.run_until_idle()
    assert owner_of_finished(h) is None
    assert h.connector.guard.violations[("a", "zero_async")] >= 1
    assert req.request_id not in h.scheduler.requests
    h.assert_clean()


def owner_of_finished(h):
    return h.connector.ownership() or None


def test_zero_async_raises_in_strict_mode(harness):
    script("a", Behaviour(break_zero_async=True))
    h = harness(kvcompose_config(chain("root", leaf("a")), strict=True))
    h.add_request(prompt(40))
    with pytest.raises(ContractViolation, match="zero_async"):
        h.step()


def test_zero_async_crashes_the_scheduler_without_a_guard(harness):
    """The naive behaviour: hand the child's (0, True) straight to vLLM's scheduler."""
    script("a", Behaviour(break_zero_async=True))
    h = harness(direct("a"))
    h.add_request(prompt(40))
    with pytest.raises(AssertionError):
        h.step()


def test_pending_child_holds_first_until_it_answers(harness):
    a = script("a", Behaviour(pending_lookups=2))
    script("b", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80))
    h.step()
    assert owner_of(h, req.request_id)["state"] == "pending"
    h.step()
    h.step()
    assert a.lookups(req.request_id) == 3
    assert owner_of(h, req.request_id)["owner"] == "b"
    h.run_until_idle()
    h.assert_clean()


def test_pending_child_past_the_deadline_counts_as_a_miss(harness):
    script("a", Behaviour(pending_lookups=10_000))
    script("b", Behaviour(tokens=32))
    tree = chain("root", leaf("a"), leaf("b"), lookup_timeout_s=1e-9)
    h = harness(kvcompose_config(tree))
    req = h.add_request(prompt(80))
    h.step()  # a answers None: pending, the clock starts
    h.step()  # deadline passed: a is a miss, b owns
    assert owner_of(h, req.request_id)["owner"] == "b"
    h.run_until_idle()
    h.assert_clean()


def test_earlier_hit_is_not_blocked_by_a_later_pending_child(harness):
    """Upstream returns None while *any* child is pending, even after an earlier full hit
    (W3). With ``first``, kvcompose decides as soon as the earlier child hits."""
    script("a", Behaviour(tokens=48))
    b = script("b", Behaviour(pending_lookups=10_000))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80))
    h.step()
    assert owner_of(h, req.request_id)["owner"] == "a"
    assert b.lookups(req.request_id) == 0
    h.run_until_idle()
    h.assert_clean()


def test_upstream_multiconnector_blocks_on_a_later_pending_child(harness):
    script("a", Behaviour(tokens=48))
    script("b", Behaviour(pending_lookups=10_000))
    h = harness(multiconnector_config(leaf("a"), leaf("b")))
    req = h.add_request(prompt(80))
    for _ in range(5):
        h.step()
    assert req.num_computed_tokens == 0  # still waiting on b, five steps in
    h.abort(req.request_id)
    h.run_until_idle()


def test_child_error_in_lookup_is_a_miss(harness):
    a = script("a", Behaviour(tokens=32, raise_in=frozenset({"get_num_new_matched_tokens"})))
    script("b", Behaviour(tokens=16))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80))
    h.step()
    assert owner_of(h, req.request_id)["owner"] == "b"
    h.run_until_idle()
    assert a.finished[req.request_id] == 1
    assert sum(h.connector.guard.errors.values()) >= 1
    h.assert_clean()


# -------------------------------------------------------------- one terminal signal
def test_only_the_owners_receive_goes_up(harness):
    script("a", Behaviour(tokens=48, is_async=True))
    script("b", Behaviour(break_rogue_recv=True))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(80), max_tokens=3)
    h.run_until_idle()
    assert req.request_id not in h.scheduler.requests
    assert h.worker_connector.guard.violations[("b", "unexpected_recv")] >= 1
    h.assert_clean()


def test_upstream_multiconnector_crashes_on_a_non_owner_receive(harness):
    script("a", Behaviour(tokens=48, is_async=True))
    script("b", Behaviour(break_rogue_recv=True))
    h = harness(multiconnector_config(leaf("a"), leaf("b")))
    h.add_request(prompt(80), max_tokens=3)
    with pytest.raises(AssertionError):
        h.run_until_idle()


def test_duplicate_receive_goes_up_once(harness):
    script("a", Behaviour(tokens=48, is_async=True, break_duplicate_recv=True))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    req = h.add_request(prompt(80), max_tokens=4)
    h.run_until_idle()
    assert req.request_id not in h.scheduler.requests
    assert h.worker_connector.guard.violations[("a", "unexpected_recv")] == 1
    h.assert_clean()


def test_finished_sending_waits_for_every_delaying_child(harness):
    script("a", Behaviour(delay_free=True, send_steps=1))
    script("b", Behaviour(delay_free=True, send_steps=4))
    script("c", Behaviour())
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"), leaf("c"))))
    req = h.add_request(prompt(40), max_tokens=1)
    rid = req.request_id
    steps_held = 0
    for _ in range(20):
        h.step()
        if rid in h.scheduler.requests and req.is_finished():
            steps_held += 1
        if rid not in h.scheduler.requests:
            break
    assert rid not in h.scheduler.requests
    assert steps_held >= 3, "blocks were freed before the slower child finished sending"
    h.assert_clean()


def test_a_send_nobody_delayed_is_dropped(harness):
    script("a", Behaviour(break_rogue_send=True))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    h.add_request(prompt(40), max_tokens=1)
    h.run_until_idle()
    assert h.worker_connector.guard.violations[("a", "unexpected_send")] == 1
    h.assert_clean()


# ----------------------------------------------------------------- kv_transfer_params
def test_params_from_several_children_are_merged(harness):
    script("a", Behaviour(params={"x": 1}))
    script("b", Behaviour(params={"y": 2}))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    req = h.add_request(prompt(40), max_tokens=1)
    results = h.run_until_idle()
    params = [
        r.finished[req.request_id].kv_transfer_params
        for r in results
        if req.request_id in r.finished
    ]
    assert params == [{"x": 1, "y": 2}]
    h.assert_clean()


def test_params_clash_names_both_children(harness):
    script("a", Behaviour(params={"x": 1}))
    script("b", Behaviour(params={"x": 2}))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b")), strict=True))
    h.add_request(prompt(40), max_tokens=1)
    with pytest.raises(ContractViolation, match=r"'b'.*'x'.*'a'"):
        h.run_until_idle()


# -------------------------------------------------------------------- load failures
def test_total_load_failure_falls_back_to_the_next_child(harness):
    a = script("a", Behaviour(tokens=64, is_async=True, load="fail"))
    b = script("b", Behaviour(tokens=48))
    h = harness(
        kvcompose_config(chain("root", leaf("a"), leaf("b"))), kv_load_failure_policy="recompute"
    )
    req = h.add_request(prompt(80), max_tokens=2)
    h.run_until_idle()
    rid = req.request_id
    assert a.lookups(rid) == 1, "the failed child must be skipped on the re-lookup"
    assert 48 in ext_allocs(b, rid), "the next child serves the request"
    h.assert_clean()


def test_load_failure_with_fail_policy_finishes_the_request_with_an_error(harness):
    script("a", Behaviour(tokens=64, is_async=True, load="fail"))
    h = harness(kvcompose_config(chain("root", leaf("a"))), kv_load_failure_policy="fail")
    req = h.add_request(prompt(80), max_tokens=2)
    results = h.run_until_idle()
    reasons = [
        r.finished[req.request_id].finish_reason for r in results if req.request_id in r.finished
    ]
    assert reasons and "error" in str(reasons[0]).lower()
    h.assert_clean()


# ------------------------------------------------------------------ aborts, preemption
def test_abort_while_loading_leaks_nothing(harness):
    a = script("a", Behaviour(tokens=64, is_async=True, load_steps=4))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    req = h.add_request(prompt(80), max_tokens=4)
    h.step()
    assert owner_of(h, req.request_id)["state"] == "loading"
    h.abort(req.request_id)
    h.run_until_idle()
    assert a.finished[req.request_id] == 1
    h.assert_clean()


def test_abort_while_pending_leaks_nothing(harness):
    a = script("a", Behaviour(pending_lookups=10_000))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    req = h.add_request(prompt(80))
    h.step()
    h.abort(req.request_id)
    h.run_until_idle()
    assert a.finished[req.request_id] == 1
    h.assert_clean()


def test_preempted_request_is_looked_up_again(harness):
    a = script("a", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    req = h.add_request(prompt(80), max_tokens=6)
    h.step()
    h.step()
    h.preempt(req.request_id)
    h.run_until_idle()
    assert a.lookups(req.request_id) >= 2
    assert a.finished[req.request_id] == 1
    h.assert_clean()


# ------------------------------------------------------------------ route and fan-out
def test_route_by_kv_transfer_params(harness):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=64))
    tree = {
        "kind": "route",
        "name": "root",
        "default": "a",
        "rules": [{"child": "b", "param": "tier", "equals": "b"}],
        "children": [leaf("a"), leaf("b")],
    }
    h = harness(kvcompose_config(tree))
    to_b = h.add_request(prompt(80, 1), kv_transfer_params={"tier": "b"})
    to_a = h.add_request(prompt(80, 2), kv_transfer_params={"tier": "other"})
    h.step()
    assert owner_of(h, to_b.request_id)["owner"] == "b"
    assert owner_of(h, to_a.request_id)["owner"] == "a"
    assert b.lookups(to_a.request_id) == 0 and a.lookups(to_b.request_id) == 0
    h.run_until_idle()
    h.assert_clean()


def test_route_with_malformed_params_falls_back_to_default(harness):
    script("a", Behaviour(tokens=32))
    script("b", Behaviour(tokens=64))
    tree = {
        "kind": "route",
        "name": "root",
        "default": "a",
        "rules": [{"child": "b", "param": "tier"}],
        "children": [leaf("a"), leaf("b")],
    }
    h = harness(kvcompose_config(tree))
    req = h.add_request(prompt(80), kv_transfer_params={"tier": None})
    h.step()
    assert owner_of(h, req.request_id)["owner"] == "b"  # present key matches
    h.run_until_idle()
    h.assert_clean()


def test_fanout_loads_only_from_the_designated_child_and_saves_to_all(harness):
    a = script("a", Behaviour(tokens=64))
    b = script("b", Behaviour(tokens=32))
    tree = {"kind": "fanout", "name": "root", "load_from": "b", "children": [leaf("a"), leaf("b")]}
    h = harness(kvcompose_config(tree))
    req = h.add_request(prompt(80))
    h.run_until_idle()
    assert a.lookups(req.request_id) == 0
    assert ext_allocs(b, req.request_id)[0] == 32
    assert ("wait_for_save",) in a.calls and ("wait_for_save",) in b.calls
    h.assert_clean()


def test_save_false_child_never_saves(harness):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour())
    h = harness(kvcompose_config(chain("root", leaf("a", save=False), leaf("b"))))
    h.add_request(prompt(40), max_tokens=1)
    h.run_until_idle()
    assert ("wait_for_save",) not in a.calls
    assert ("wait_for_save",) in b.calls
    h.assert_clean()


# ------------------------------------------------------------------------ nesting
def test_two_levels_of_nesting(harness):
    """root = chain[longest]( route(param→fast | default→chain[first](slow1, slow2)), disk )"""
    fast = script("fast", Behaviour(tokens=32))
    slow1 = script("slow1", Behaviour())
    slow2 = script("slow2", Behaviour(tokens=48, is_async=True, load_steps=2))
    disk = script("disk", Behaviour(tokens=16, delay_free=True, send_steps=2))
    inner = chain("slow", leaf("slow1"), leaf("slow2"))
    route = {
        "kind": "route",
        "name": "pick",
        "default": "slow",
        "rules": [{"child": "fast", "param": "fast"}],
        "children": [leaf("fast"), inner],
    }
    h = harness(kvcompose_config(chain("root", route, leaf("disk"), policy="longest")))
    r_fast = h.add_request(prompt(80, 1), kv_transfer_params={"fast": True}, max_tokens=2)
    r_slow = h.add_request(prompt(80, 2), max_tokens=2)
    h.step()
    root = h.connector.ownership()
    assert root[r_fast.request_id]["owner"] == "pick"
    assert root[r_slow.request_id]["owner"] == "pick"
    pick = h.connector.children[0].connector
    assert pick.ownership()[r_slow.request_id]["owner"] == "slow"
    h.run_until_idle()
    assert ext_allocs(fast, r_fast.request_id) == [32]
    assert ext_allocs(slow2, r_slow.request_id) == [48, 0]
    assert ext_allocs(slow1, r_slow.request_id) == [0, 0]
    for s in (fast, slow1, slow2, disk):
        assert s.finished[r_fast.request_id] == 1 and s.finished[r_slow.request_id] == 1
    h.assert_clean()
    assert h.connector.live_requests() == {} and h.worker_connector.live_requests() == {}


# -------------------------------------------------------------------- configuration
def test_children_inherit_top_level_fields_and_may_set_their_own_engine_id(harness):
    script("a", Behaviour())
    script("b", Behaviour())
    tree = chain("root", leaf("a", engine_id="engine-a"), leaf("b"))
    h = harness(kvcompose_config(tree, engine_id="top"), kv_load_failure_policy="recompute")
    a_cfg = h.connector.children[0].connector._kv_transfer_config
    b_cfg = h.connector.children[1].connector._kv_transfer_config
    assert a_cfg.engine_id == "engine-a"
    assert b_cfg.engine_id == "top"
    assert b_cfg.kv_load_failure_policy == "recompute"


def test_upstream_multiconnector_rejects_a_child_engine_id(harness):
    script("a", Behaviour())
    config = multiconnector_config(leaf("a"))
    config["kv_connector_extra_config"]["connectors"][0]["engine_id"] = "engine-a"
    with pytest.raises(TypeError, match="engine_id"):
        harness(config)


def test_stats_are_keyed_by_node_name(harness):
    """Through vLLM's own stats path: the scheduler collects the composite's stats each step."""
    from kvcompose import KVCompose

    script("a", Behaviour(tokens=32))
    script("b", Behaviour(tokens=64))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"), policy="longest")))
    h.add_request(prompt(80, 1))
    h.add_request(prompt(80, 2))
    total = None
    for result in h.run_until_idle():
        for outputs in result.engine_core_outputs.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                step = KVCompose.build_kv_connector_stats(stats.kv_connector_stats)
                total = step if total is None else total.aggregate(step)
    assert total is not None
    assert total.counters["hits.b"] == 2
    assert total.counters["hit_tokens.b"] == 128
    assert "hits.a" not in total.counters
    assert total.reduce()["lookups"] == 2
    h.assert_clean()


# ------------------------------------------------------------------------------- HMA
def test_hma_variant_refuses_children_without_hma_support(harness):
    from kvcompose.composite.children import ChildConfigError

    script("a", Behaviour())
    config = kvcompose_config(chain("root", leaf("a")))
    config["kv_connector"] = "KVComposeHMA"
    with pytest.raises(ChildConfigError, match="does not support the hybrid KV cache manager"):
        harness(config)


def test_plain_variant_runs_with_hma_turned_off(harness):
    script("a", Behaviour(tokens=32))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    assert h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    h.add_request(prompt(40))
    h.run_until_idle()
    h.assert_clean()


def test_no_second_lookup_after_an_async_load_completed(harness):
    a = script("a", Behaviour(tokens=48, is_async=True, load_steps=3))
    h = harness(kvcompose_config(chain("root", leaf("a"))))
    req = h.add_request(prompt(80), max_tokens=4)
    h.run_until_idle()
    assert a.lookups(req.request_id) == 1
    assert ext_allocs(a, req.request_id) == [48, 0]
    h.assert_clean()


def test_a_child_whose_lookups_keep_failing_is_taken_out_of_lookups(harness):
    from kvcompose.composite.guard import MAX_LOOKUP_ERRORS

    a = script("a", Behaviour(tokens=32, raise_in=frozenset({"get_num_new_matched_tokens"})))
    script("b", Behaviour(tokens=16))
    h = harness(kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    reqs = [h.add_request(prompt(40, seed), max_tokens=1) for seed in range(MAX_LOOKUP_ERRORS + 2)]
    h.run_until_idle()
    asked = sum(a.lookups(r.request_id) for r in reqs)
    assert asked == MAX_LOOKUP_ERRORS, "after repeated errors, a is no longer asked"
    assert all(a.finished[r.request_id] == 1 for r in reqs), "...but still hears every finish"
    assert 0 in h.connector.guard.disabled
    h.assert_clean()


def test_on_error_fail_lets_the_error_through(harness):
    script("a", Behaviour(tokens=32, raise_in=frozenset({"get_num_new_matched_tokens"})))
    h = harness(kvcompose_config(chain("root", leaf("a", on_error="fail"))))
    h.add_request(prompt(40))
    with pytest.raises(RuntimeError, match="scripted failure"):
        h.step()


def test_route_rules_that_cannot_be_evaluated_fall_back_to_the_default(harness):
    script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=64))
    tree = {
        "kind": "route",
        "name": "root",
        "default": "a",
        "rules": [{"child": "b", "predicate": "kvcompose.testing.trees:predicate_reading_params"}],
        "children": [leaf("a"), leaf("b")],
    }
    h = harness(kvcompose_config(tree))
    high = h.add_request(prompt(80, 1), kv_transfer_params={"priority": 9})
    missing = h.add_request(prompt(80, 2), kv_transfer_params={"other": 1})
    garbage = h.add_request(prompt(80, 3), kv_transfer_params={"priority": "high"})
    h.step()
    assert owner_of(h, high.request_id)["owner"] == "b"
    for req in (missing, garbage):
        assert owner_of(h, req.request_id)["owner"] == "a"
        assert b.lookups(req.request_id) == 0
    h.run_until_idle()
    h.assert_clean()


# --------------------------------------------------------------- worker-side errors
@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_a_child_raising_while_loading_fails_only_its_own_load(harness, is_async):
    """a raises in start_load_kv for r_a's load: r_a's load is reported failed (async: a
    failed receive; sync: its blocks as invalid) and recomputed, r_b's load by b is
    untouched, and nothing hangs."""
    a = script(
        "a",
        Behaviour(),
        r_a=Behaviour(tokens=48, is_async=is_async, raise_in=frozenset({"start_load_kv"})),
    )
    b = script("b", Behaviour(), r_b=Behaviour(tokens=48, is_async=is_async))
    h = harness(
        kvcompose_config(chain("root", leaf("a"), leaf("b"))), kv_load_failure_policy="recompute"
    )
    h.add_request(prompt(80, 1), request_id="r_a", max_tokens=2)
    h.add_request(prompt(80, 2), request_id="r_b", max_tokens=2)
    results = h.run_until_idle()
    assert h.worker_connector.guard.errors[("a", "start_load_kv:RuntimeError")] >= 1
    outputs = [r.kv_connector_output for r in results if r.kv_connector_output is not None]
    if is_async:
        failed = set().union(*(o.failed_recving for o in outputs))
        assert failed == {"r_a"}, "a's load is reported failed, b's is not"
    else:
        invalid = set().union(*(o.invalid_block_ids for o in outputs))
        ((_, a_blocks),) = [x for x in a.allocations("r_a") if x[0] > 0]
        assert invalid and invalid <= set(a_blocks), "only a's loaded blocks are reported"
    assert ext_allocs(b, "r_b")[0] == 48
    assert h.finished["r_a"].finish_reason is not None and h.finished["r_b"] is not None
    if is_async:
        assert a.lookups("r_a") == 1, "the failed child is skipped on the re-lookup"
    h.assert_clean()


def test_a_child_that_cannot_be_built_is_named_in_the_error(harness_factory, tmp_path):
    # A store whose directory is a file: the store's own OSError goes up unchanged (vLLM
    # shows it), with a note naming the node, in the inner and the outer composite.
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    store = {
        "leaf": {
            "name": "disk",
            "connector": "PrefixStoreConnector",
            "module_path": "kvcompose.stores",
            "extra_config": {"path": str(a_file)},
        }
    }
    inner = {
        "leaf": {
            "name": "inner",
            "connector": "KVCompose",
            "module_path": "kvcompose",
            "extra_config": {"tree": {"chain": {"name": "tiers", "children": [store]}}},
        }
    }
    config = {"kv_connector": "KVCompose", "kv_connector_module_path": "kvcompose",
              "kv_connector_extra_config": {"tree": {"chain": {"name": "root",
                                                               "children": [inner]}}}}  # fmt: skip
    with pytest.raises(FileExistsError) as info:
        harness_factory(config)
    assert info.value.__notes__ == [
        "(raised building kvcompose node 'disk', a PrefixStoreConnector)",
        "(raised building kvcompose node 'inner', a KVCompose)",
    ]
