"""``policy: stitch`` on vLLM's real scheduler, with scripted children (see ``stitch_helpers``)."""

from __future__ import annotations

from stitch_helpers import allocs, lookups_at, native, stitch_config
from stitch_helpers import scheduled_per_step as scheduled

from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import prompt


def test_two_sync_children_each_load_their_own_range(harness):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=80))
    h = harness(stitch_config(native("a"), native("b")))
    req = h.add_request(prompt(100), max_tokens=2)
    rid = req.request_id
    h.step()
    record = h.connector.ownership()[rid]
    assert record["owner"] is None
    assert [s["child"] for s in record["segments"]] == ["a", "b"]
    assert [s["range"] for s in record["segments"]] == [[0, 32], [32, 80]]
    assert lookups_at(a, rid) == [0] and lookups_at(b, rid) == [32]
    assert allocs(a, rid) == [32] and allocs(b, rid) == [48]
    # vLLM computes only what neither child holds
    assert scheduled(h, rid)[0] == 100 - 80
    h.run_until_idle()
    assert a.finished[rid] == 1 and b.finished[rid] == 1
    h.assert_clean()


def test_a_stitch_never_reloads_a_range_and_the_blocks_are_disjoint(harness):
    script("a", Behaviour(tokens=32))
    script("b", Behaviour(tokens=64))
    script("c", Behaviour(tokens=96))
    h = harness(stitch_config(native("a"), native("b"), native("c")))
    req = h.add_request(prompt(120), max_tokens=3)
    h.step()
    segments = h.connector.ownership()[req.request_id]["segments"]
    assert [s["range"] for s in segments] == [[0, 32], [32, 64], [64, 96]]
    assert [s["blocks"] for s in segments] == [2, 2, 2]
    h.run_until_idle()
    h.assert_clean()


def test_sync_and_async_segments_give_one_receive(harness):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=80, is_async=True, load_steps=2))
    c = script("c", Behaviour(tokens=96, is_async=True, load_steps=1))
    h = harness(stitch_config(native("a"), native("b"), native("c")))
    req = h.add_request(prompt(120), max_tokens=2)
    rid = req.request_id
    h.step()
    assert h.connector.ownership()[rid]["state"] == "loading"
    receives = []
    for _ in range(4):
        result = h.step()
        if rid in (result.kv_connector_output.finished_recving or ()):
            receives.append(result.step)
    assert len(receives) == 1, "one finished_recving for the stitched request"
    assert b.recv_reports(rid) == [False] and c.recv_reports(rid) == [False]
    assert allocs(a, rid)[0] == 32 and allocs(b, rid)[0] == 48 and allocs(c, rid)[0] == 16
    # the second pass after the async load tells every child 0
    assert allocs(a, rid)[1:] == [0] and allocs(b, rid)[1:] == [0]
    h.run_until_idle()
    assert h.finished[rid].finish_reason is not None
    h.assert_clean()


def test_the_local_hit_comes_first_and_the_stitch_starts_after_it(harness):
    a = script("a", Behaviour(tokens=48))
    b = script("b", Behaviour(tokens=96))
    h = harness(stitch_config(native("a"), native("b")))
    tokens = prompt(120)
    first = h.add_request(tokens[:40], max_tokens=1)  # leaves 32 tokens in the local cache
    h.run_until_idle()
    again = h.add_request(tokens, max_tokens=3)
    h.step()
    rid = again.request_id
    assert lookups_at(a, rid) == [32] and lookups_at(b, rid) == [48]
    segments = h.connector.ownership()[rid]["segments"]
    assert [s["range"] for s in segments] == [[32, 48], [48, 96]]
    assert first.request_id in h.finished
    h.run_until_idle()
    h.assert_clean()


def test_an_unknown_connector_only_loads_alone(harness):
    """A scripted child without ``load_range`` is unknown to the table: sole owner."""
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=80))
    h = harness(stitch_config(native("a"), leaf("b")))
    req = h.add_request(prompt(100), max_tokens=3)
    h.step()
    record = h.connector.ownership()[req.request_id]
    assert record["owner"] == "a" and "segments" not in record
    assert lookups_at(b, req.request_id) == []
    assert allocs(b, req.request_id) == [0]
    h.run_until_idle()
    assert a.finished[req.request_id] == 1
    h.assert_clean()


def test_a_misaligned_start_skips_the_child(harness):
    script("a", Behaviour(tokens=40))  # ends inside a block
    b = script("b", Behaviour(tokens=96))
    h = harness(stitch_config(native("a"), native("b")))
    req = h.add_request(prompt(120), max_tokens=3)
    h.step()
    assert lookups_at(b, req.request_id) == []
    assert h.connector.ownership()[req.request_id]["owner"] == "a"
    h.run_until_idle()
    h.assert_clean()


def test_abort_while_segments_load_waits_for_all_of_them(harness):
    script("a", Behaviour(tokens=32, is_async=True, load_steps=1))
    b = script("b", Behaviour(tokens=80, is_async=True, load_steps=4))
    h = harness(stitch_config(native("a"), native("b")))
    req = h.add_request(prompt(100), max_tokens=2)
    rid = req.request_id
    h.step()
    h.step()  # a has reported; b still loads
    h.abort(rid)
    free_before = h.num_free_blocks()
    h.step()
    assert h.num_free_blocks() == free_before, "blocks freed while b still loads into them"
    h.run_until_idle()
    assert b.recv_reports(rid) == [False]
    h.assert_clean()


def test_a_failed_later_segment_keeps_the_earlier_one(harness):
    """Single KV cache group, no other child holds the gap: the failed segment's blocks go up
    as invalid blocks with the one receive, so vLLM keeps the valid prefix before it and
    recomputes the rest."""
    a = script("a", Behaviour(tokens=32, is_async=True))
    b = script("b", Behaviour(tokens=80, is_async=True, load_steps=2, load="fail"))
    h = harness(stitch_config(native("a"), native("b")), kv_load_failure_policy="recompute")
    req = h.add_request(prompt(100), max_tokens=2)
    rid = req.request_id
    h.run_until_idle()
    assert sum(scheduled(h, rid)) == 100 - 32 + 1  # after a's segment, and one decode
    assert lookups_at(a, rid) == [0, 32]  # asked for the gap (a miss); b is excluded
    assert b.lookups(rid) == 1  # vLLM kept [0, 32): no re-lookup
    assert a.recv_reports(rid) == [False] and b.recv_reports(rid) == [True]
    h.assert_clean()


def test_a_failed_first_segment_falls_back_to_a_re_lookup_without_it(harness):
    """The first segment failing leaves no valid prefix: vLLM resets the request and looks
    it up again; the failed child is skipped, so the next child covers the request."""
    a = script("a", Behaviour(tokens=32, is_async=True, load="fail"))
    b = script("b", Behaviour(tokens=80, is_async=True, load_steps=2))
    h = harness(stitch_config(native("a"), native("b")), kv_load_failure_policy="recompute")
    req = h.add_request(prompt(100), max_tokens=2)
    rid = req.request_id
    h.run_until_idle()
    assert a.lookups(rid) == 1 and lookups_at(b, rid) == [32, 0]
    assert sum(scheduled(h, rid)) == 100 - 80 + 1
    assert b.recv_reports(rid) == [False, False]
    h.assert_clean()


def test_a_failed_segment_under_policy_fail_fails_the_request(harness):
    script("a", Behaviour(tokens=32, is_async=True))
    script("b", Behaviour(tokens=80, is_async=True, load="fail"))
    h = harness(stitch_config(native("a"), native("b")), kv_load_failure_policy="fail")
    req = h.add_request(prompt(100), max_tokens=2)
    h.run_until_idle()
    assert h.finished[req.request_id].finish_reason is not None
    assert not h.finished[req.request_id].output_token_ids
    h.assert_clean()


def test_every_child_outside_the_segments_hears_zero(harness):
    a = script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=0))
    c = script("c", Behaviour(tokens=64))
    h = harness(stitch_config(native("a"), native("b"), native("c")))
    req = h.add_request(prompt(100), max_tokens=2)
    rid = req.request_id
    h.run_until_idle()
    assert allocs(a, rid) == [32] and allocs(b, rid) == [0] and allocs(c, rid) == [32]
    assert lookups_at(b, rid) == [32] and lookups_at(c, rid) == [32]
    h.assert_clean()


def test_a_last_segment_child_is_handed_a_block_view_from_its_start(harness):
    """A NIXL-like child (loads every unhashed block it is handed) pulls exactly its range
    through the view; with the full blocks it would pull the earlier segment's blocks too."""
    script("a", Behaviour(tokens=32, is_async=True))
    tail = script("tail", Behaviour(tokens=96, is_async=True, loads_unhashed=True))
    h = harness(stitch_config(native("a"), leaf("tail", load_range="last_segment"), native("c")))
    script("c", Behaviour(tokens=120))
    req = h.add_request(prompt(120), max_tokens=2)
    rid = req.request_id
    h.step()
    segments = h.connector.ownership()[rid]["segments"]
    assert [(s["child"], s["range"]) for s in segments] == [("a", [0, 32]), ("tail", [32, 96])]
    blocks = h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
    loaded = [c[2] for c in tail.calls if c[0] == "loaded_blocks" and c[1] == rid]
    assert loaded == [tuple(blocks[2:6])]
    assert allocs(tail, rid)[0] == 64
    h.run_until_idle()
    h.assert_clean()


def test_a_natural_end_child_is_skipped_after_an_async_segment(harness):
    """LMCache-like (sync, loads to its own end): only in sync stitches."""
    script("a", Behaviour(tokens=32, is_async=True))
    lm = script("lm", Behaviour(tokens=64))
    h = harness(stitch_config(native("a"), leaf("lm", load_range="natural_end")))
    req = h.add_request(prompt(100), max_tokens=2)
    h.step()
    assert lookups_at(lm, req.request_id) == []
    assert h.connector.ownership()[req.request_id]["owner"] == "a"
    h.run_until_idle()
    h.assert_clean()


def test_after_a_natural_end_child_no_async_segment_joins(harness):
    script("lm", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=64, is_async=True))
    c = script("c", Behaviour(tokens=96))
    h = harness(
        stitch_config(
            leaf("lm", load_range="natural_end", load_range_alignment=16),
            native("b"),
            native("c"),
        )
    )
    req = h.add_request(prompt(120), max_tokens=2)
    rid = req.request_id
    h.step()
    segments = h.connector.ownership()[rid]["segments"]
    assert [(s["child"], s["range"]) for s in segments] == [("lm", [0, 32]), ("c", [32, 96])]
    assert lookups_at(b, rid) == [32] and allocs(b, rid) == [0]
    assert allocs(c, rid) == [64]
    h.run_until_idle()
    h.assert_clean()


def test_a_start_off_the_childs_alignment_skips_it(harness):
    script("a", Behaviour(tokens=32))
    b = script("b", Behaviour(tokens=96))
    h = harness(stitch_config(native("a"), native("b", load_range_alignment=64)))
    req = h.add_request(prompt(120), max_tokens=2)
    h.step()
    assert lookups_at(b, req.request_id) == []
    h.run_until_idle()
    h.assert_clean()
