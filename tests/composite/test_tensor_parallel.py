"""A composite under tensor parallelism: two worker ranks, on vLLM's real scheduler.

Each rank runs its own worker-side composite (as each worker process builds its own) over the
same metadata, and vLLM's ``KVOutputAggregator`` combines their outputs: a receive counts once
both ranks reported it, ``failed_recving`` and invalid blocks from either rank count, and the
worker metadata (``ComposedWorkerMeta``, with a stitched load's failed segments) is aggregated
rank by rank. Here a load fails on one rank only (``Behaviour.fails_on_ranks``): the other
rank's half of the KV loaded fine, but the request must be treated as failed all the same.
"""

from __future__ import annotations

from stitch_helpers import BLOCK, allocs, lookups_at, native, receives, scheduled
from stitch_helpers import stitch_config as stitch

from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

PROMPT = 100
RANK1 = frozenset({1})


def failed_receives(h, req_id) -> int:
    return sum(req_id in (r.kv_connector_output.failed_recving or ()) for r in h.history)


def tp2(harness, config, **kw):
    return harness(config, num_workers=2, kv_load_failure_policy="recompute", **kw)


def test_each_rank_gets_its_own_worker_composite(harness):
    script("a", Behaviour(tokens=48, is_async=True, load_steps=2))
    h = tp2(harness, kvcompose_config(chain("root", leaf("a"))))
    assert len(h.worker_connectors) == 2
    assert h.worker_connectors[0] is not h.worker_connectors[1]
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert receives(h, rid) == 1 and not failed_receives(h, rid)
    assert scheduled(h, rid) == PROMPT - 48 + 1
    h.assert_clean()


def test_an_async_load_failed_on_one_rank_fails_the_request(harness):
    """a's load fails on rank 1 only: vLLM hears one failed receive and recomputes; the
    re-lookup excludes a, so b (which holds less) loads instead."""
    a = script("a", Behaviour(tokens=48, is_async=True, load="fail", fails_on_ranks=RANK1))
    b = script("b", Behaviour(tokens=32, is_async=True))
    h = tp2(harness, kvcompose_config(chain("root", leaf("a"), leaf("b"))))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert sorted(a.recv_reports(rid)) == [False, True], "rank 0 loaded, rank 1 failed"
    assert failed_receives(h, rid) == 1 and receives(h, rid) == 2
    assert allocs(b, rid)[:2] == [0, 32], "the re-lookup's load is b's"
    assert scheduled(h, rid) == PROMPT - 32 + 1
    h.assert_clean()


def test_a_sync_load_invalid_on_one_rank_cuts_the_request_back(harness):
    a = script("a", Behaviour(tokens=64, load="invalid", invalid_block=2, fails_on_ranks=RANK1))
    h = tp2(harness, kvcompose_config(chain("root", leaf("a"))))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert [c[1] for c in a.calls if c[0] == "invalid_report"] == [(a.allocations(rid)[0][1][2],)]
    # the first step computes past the load; then vLLM keeps the two good blocks and
    # recomputes from the bad one
    assert scheduled(h, rid) == (PROMPT - 64) + (PROMPT - 2 * BLOCK) + 1
    h.assert_clean()


def test_a_stitched_segment_failed_on_one_rank_is_reloaded_on_both(harness):
    """a [0, 32) and b [32, 80), both async; b fails on rank 1 only. Rank 1 hides it and
    names b in its worker metadata; the aggregated metadata reaches the scheduler half, which
    has c reload exactly [32, 80) on both ranks. vLLM sees one good receive, after the reload,
    and computes nothing it could have loaded."""
    script("a", Behaviour(tokens=32, is_async=True))
    b = script("b", Behaviour(tokens=80, is_async=True, load="fail", fails_on_ranks=RANK1))
    c = script("c", Behaviour(tokens=80, is_async=True, load_steps=2))
    h = tp2(harness, stitch(native("a"), native("b"), native("c")))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert sorted(b.recv_reports(rid)) == [False, True]
    assert lookups_at(c, rid) == [80, 32] and allocs(c, rid)[:2] == [0, 48]
    assert c.recv_reports(rid) == [False, False], "both ranks reloaded the gap"
    assert receives(h, rid) == 1 and not failed_receives(h, rid)
    assert scheduled(h, rid) == PROMPT - 80 + 1
    counters = h.connector.stats_totals()["counters"]
    assert counters["reloaded_tokens.c"] == 48 and counters["reloads.c"] == 1
    h.assert_clean()


def test_a_stitched_segment_invalid_on_one_rank_is_reloaded(harness):
    script("a", Behaviour(tokens=32, is_async=True))
    script("b", Behaviour(tokens=80, is_async=True, load="invalid", fails_on_ranks=RANK1))
    c = script("c", Behaviour(tokens=80, is_async=True))
    h = tp2(harness, stitch(native("a"), native("b"), native("c")))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(c, rid)[:2] == [0, 48]
    assert receives(h, rid) == 1 and not failed_receives(h, rid)
    assert not any(r.kv_connector_output.invalid_block_ids for r in h.history)
    assert scheduled(h, rid) == PROMPT - 80 + 1
    h.assert_clean()


def test_an_unreloaded_stitched_segment_failed_on_one_rank_is_given_up(harness):
    """No child can reload b's range: the scheduler half gives it up, and vLLM keeps a's
    [0, 32) and recomputes the rest, on both ranks alike."""
    script("a", Behaviour(tokens=32, is_async=True))
    script("b", Behaviour(tokens=80, is_async=True, load="fail", fails_on_ranks=RANK1))
    h = tp2(harness, stitch(native("a"), native("b")))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert receives(h, rid) == 1
    assert scheduled(h, rid) == PROMPT - 32 + 1
    h.assert_clean()


def test_segments_failed_on_different_ranks_are_both_reloaded(harness):
    """a's segment fails on rank 0 and b's on rank 1, in the same step: each rank's worker
    metadata names one failed child, and their aggregate must name both (the scheduler half
    sees only the aggregate). c reloads the whole gap [0, 80)."""
    a = script("a", Behaviour(tokens=32, is_async=True, load="fail", fails_on_ranks=frozenset({0})))
    b = script("b", Behaviour(tokens=80, is_async=True, load="fail", fails_on_ranks=RANK1))
    c = script("c", Behaviour(tokens=80, is_async=True))
    h = tp2(harness, stitch(native("a"), native("b"), native("c")))
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert sorted(a.recv_reports(rid)) == sorted(b.recv_reports(rid)) == [False, True]
    assert lookups_at(c, rid)[-1] == 0 and allocs(c, rid)[:2] == [0, 80]
    assert receives(h, rid) == 1 and not failed_receives(h, rid)
    assert scheduled(h, rid) == PROMPT - 80 + 1
    h.assert_clean()
