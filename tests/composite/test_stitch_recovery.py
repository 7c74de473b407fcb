"""``policy: stitch`` recovering from a failed segment, on vLLM's real scheduler.

While the request is parked, a failed segment's range is reloaded by another able child
(``native``, not excluded, not the failed one), looked up at the gap's start; what no child
reloads is given up (vLLM keeps the prefix before it and recomputes the rest). vLLM sees one
receive per request, after the last round. A segment that cannot be cut and straddles a
smaller grant is dropped the same way instead of refusing the grant.

Scripted children as in ``stitch_helpers``: each holds the prompt's first ``tokens`` tokens
and answers what it holds after the lookup's argument.
"""

from __future__ import annotations

import pytest
from stitch_helpers import BLOCK, allocs, lookups_at, native, receives, scheduled
from stitch_helpers import stitch_config as stitch

from kvcompose.composite.ledger import LedgerError
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

PROMPT = 100


def counters(h) -> dict[str, int]:
    return h.connector.stats_totals()["counters"]


def several_groups(h) -> None:
    """Take the composite's decisions for a model with several KV cache groups (vLLM refuses
    invalid blocks there). The tiny model has one group, so vLLM's own handling of the
    ``failed_recving`` the node then sends is the same as on such a model. What the stand-in
    cannot show vLLM refusing is checked here: no invalid block id goes up."""
    h.connector.scheduler_side.stitches.block_level_failures = False
    worker = h.worker_connector
    load_errors = worker.get_block_ids_with_load_errors

    def no_invalid_blocks() -> set[int]:
        errors = load_errors()
        assert not errors, f"invalid blocks {sorted(errors)} on a model with several groups"
        return errors

    worker.get_block_ids_with_load_errors = no_invalid_blocks


def failing_middle(c: Behaviour) -> tuple:
    """a: [0, 32) async; b: [32, 80) async, fails; c: the spare (holds nothing past 80, so
    the lookup's walk leaves it out)."""
    a = script("a", Behaviour(tokens=32, is_async=True))
    b = script("b", Behaviour(tokens=80, is_async=True, load="fail"))
    spare = script("c", c)
    return a, b, spare


@pytest.mark.parametrize("groups", ["one", "several"])
def test_a_failed_segment_is_reloaded_by_another_child_while_parked(harness, groups):
    a, b, c = failing_middle(Behaviour(tokens=80, is_async=True, load_steps=2))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    if groups == "several":
        several_groups(h)  # a whole reload needs no invalid blocks: the same on any model
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert scheduled(h, rid) == PROMPT - 80 + 1  # nothing recomputed: [32, 80) reloaded
    assert lookups_at(c, rid) == [80, 32]  # a miss in the walk, then the gap's start
    assert allocs(c, rid)[:2] == [0, 48]  # exactly the gap
    assert b.recv_reports(rid) == [True] and c.recv_reports(rid) == [False]
    assert a.lookups(rid) == 2 and b.lookups(rid) == 1  # a asked for the gap; b excluded
    assert receives(h, rid) == 1, "one receive, after the reload"
    totals = counters(h)
    assert totals["reloaded_tokens.c"] == 48 and totals["reloads.c"] == 1
    assert "reloaded_tokens.a" not in totals
    h.assert_clean()


def test_the_ledger_shows_the_failed_segment_replaced_by_the_reload(harness):
    failing_middle(Behaviour(tokens=80, is_async=True, load_steps=3))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()  # the first round: a and b load; b fails
    h.step()  # the reload goes out
    record = h.connector.ownership()[rid]
    assert record["state"] == "loading" and record["excluded"] == [1]
    assert [(s["child"], s["range"], s["state"], s.get("reload", False))
            for s in record["segments"]] == [
        ("a", [0, 32], "loaded", False),
        ("b", [32, 80], "replaced", False),
        ("c", [32, 80], "loading", True),
    ]  # fmt: skip
    h.run_until_idle()
    h.assert_clean()


def test_a_reload_of_part_of_the_gap_keeps_what_it_loaded(harness):
    """c holds only up to 64: it reloads [32, 64); vLLM recomputes from 64 on."""
    _, _, c = failing_middle(Behaviour(tokens=64, is_async=True))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(c, rid)[:2] == [0, 32]
    assert scheduled(h, rid) == PROMPT - 64 + 1
    assert counters(h)["reloaded_tokens.c"] == 32
    assert receives(h, rid) == 1
    h.assert_clean()


def test_several_groups_take_no_partial_reload_and_look_the_request_up_again(harness):
    """On several KV cache groups vLLM takes no invalid blocks: a reload of part of the gap
    is not made; the request fails whole and is looked up again without the failed child."""
    _, b, c = failing_middle(Behaviour(tokens=64, is_async=True))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    several_groups(h)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert lookups_at(c, rid) == [80, 32, 32]  # the walk, the gap (not taken), the re-lookup
    assert b.lookups(rid) == 1  # excluded from the re-lookup
    assert allocs(c, rid) == [0, 32, 0]  # no reload: its segment of the second stitch
    assert scheduled(h, rid) == PROMPT - 64 + 1
    assert "reloaded_tokens.c" not in counters(h)
    h.assert_clean()


def test_adjacent_failed_segments_are_reloaded_as_one_gap(harness):
    """a [0, 32) and b [32, 80) both fail: their ranges join into one gap, which c (one
    range a round) reloads whole, instead of [0, 32) with [32, 80) given up."""
    script("a", Behaviour(tokens=32, is_async=True, load="fail"))
    script("b", Behaviour(tokens=80, is_async=True, load="fail"))
    c = script("c", Behaviour(tokens=80, is_async=True))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert lookups_at(c, rid) == [80, 0] and allocs(c, rid)[:2] == [0, 80]
    assert scheduled(h, rid) == PROMPT - 80 + 1, "nothing recomputed"
    assert receives(h, rid) == 1
    assert counters(h)["reloaded_tokens.c"] == 80
    h.assert_clean()


def test_a_failed_reload_goes_to_the_next_child(harness):
    _, _, c = failing_middle(Behaviour(tokens=80, is_async=True, load="fail"))
    d = script("d", Behaviour(tokens=80))  # sync: the worker ends its round itself
    h = harness(
        stitch(native("a"), native("b"), native("c"), native("d")),
        kv_load_failure_policy="recompute",
    )
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert c.recv_reports(rid) == [True]
    assert lookups_at(d, rid) == [80, 32] and allocs(d, rid)[:2] == [0, 48]
    assert scheduled(h, rid) == PROMPT - 80 + 1
    totals = counters(h)
    assert totals["reloaded_tokens.c"] == 48 and totals["reloaded_tokens.d"] == 48
    assert receives(h, rid) == 1
    h.assert_clean()


def test_a_failed_sync_segment_of_a_parked_load_is_reloaded(harness):
    """A sync segment fails as invalid blocks inside its range: hidden from vLLM as well. The
    first able child reloads it, here b, which also loads a later segment (another round)."""
    script("a", Behaviour(tokens=32, load="invalid", invalid_block=1))
    b = script("b", Behaviour(tokens=80, is_async=True))
    c = script("c", Behaviour(tokens=32))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert lookups_at(b, rid) == [32, 0] and allocs(b, rid)[:2] == [48, 32]
    assert lookups_at(c, rid) == [80]
    assert b.recv_reports(rid) == [False, False]
    assert scheduled(h, rid) == PROMPT - 80 + 1
    assert not any(r.kv_connector_output.invalid_block_ids for r in h.history)
    assert receives(h, rid) == 1
    h.assert_clean()


def test_abort_while_the_reload_loads_waits_for_it(harness):
    a, b, c = failing_middle(Behaviour(tokens=80, is_async=True, load_steps=4))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()  # round one ends with b failed
    h.step()  # the reload goes out
    assert allocs(c, rid) == [0, 48]
    h.abort(rid)
    free_before = h.num_free_blocks()
    h.step()
    assert h.num_free_blocks() == free_before, "blocks freed while c still reloads into them"
    h.run_until_idle()
    assert c.recv_reports(rid) == [False]
    assert receives(h, rid) == 1
    assert a.finished[rid] == b.finished[rid] == c.finished[rid] == 1
    h.assert_clean()


def test_abort_before_the_recovery_still_gives_one_receive(harness):
    """Aborted after the round's (held) receive, before the next step plans a reload: no
    child is told a reload, and vLLM gets the receive that frees the blocks."""
    _, _, c = failing_middle(Behaviour(tokens=80, is_async=True))
    h = harness(stitch(native("a"), native("b"), native("c")), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()
    assert h.connector.ownership()[rid]["state"] == "recovering"
    assert receives(h, rid) == 0  # held back
    h.abort(rid)
    free_before = h.num_free_blocks()
    h.step()
    assert h.num_free_blocks() > free_before
    h.run_until_idle()
    assert allocs(c, rid) == [0]
    assert receives(h, rid) == 1
    h.assert_clean()


# ----------------------------------------------------------------- smaller grants


def replaying(h, tokens: int = BLOCK) -> None:
    """Make vLLM's scheduler round grants down to a block, as it does for models with bounded
    prefix replay (DeepSeek-V4.1's sliding-window MLA; ``Scheduler.schedule`` in
    vllm/v1/core/sched/scheduler.py) for a load that does not restore the replay window
    (``_load_restores_replay_window``): the same attribute its ``__init__`` sets from such a
    model's KV cache specs. It also replays the hit's last ``tokens`` tokens after the load."""
    h.scheduler.prefix_replay_tokens = tokens


def test_a_grant_cut_inside_an_uncuttable_async_segment_drops_it(harness):
    """A NIXL-like last segment [32, 99) cannot be cut; vLLM grants 96 of 99 tokens. The
    segment is dropped (its child hears 0), and the grant's part from 32 on is given up as
    invalid blocks: vLLM keeps [0, 32) (then replays its last 16 tokens)."""
    a = script("a", Behaviour(tokens=32, is_async=True, load_steps=2))
    tail = script("tail", Behaviour(tokens=120, is_async=True, loads_unhashed=True))
    h = harness(
        stitch(native("a"), leaf("tail", load_range="last_segment")),
        kv_load_failure_policy="recompute",
    )
    replaying(h)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()
    record = h.connector.ownership()[rid]
    assert record["lost_from"] == 32 and record["excluded"] == [1]
    assert [(s["child"], s["state"]) for s in record["segments"]] == [
        ("a", "loading"),
        ("tail", "dropped"),
    ]
    h.run_until_idle()
    assert allocs(tail, rid) == [0, 0]  # told 0 (NIXL frees P's blocks on it), twice
    assert allocs(a, rid)[0] == 32
    assert scheduled(h, rid) == PROMPT - (32 - BLOCK) + 1
    assert receives(h, rid) == 1
    h.assert_clean()


def test_a_grant_cut_inside_an_uncuttable_async_segment_on_several_groups_relooks_up(harness):
    a = script("a", Behaviour(tokens=32, is_async=True))
    tail = script("tail", Behaviour(tokens=120, is_async=True, loads_unhashed=True))
    h = harness(
        stitch(native("a"), leaf("tail", load_range="last_segment")),
        kv_load_failure_policy="recompute",
    )
    replaying(h)
    several_groups(h)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert tail.lookups(rid) == 1  # skipped on the re-lookup
    assert lookups_at(a, rid) == [0, 0]
    assert set(allocs(tail, rid)) == {0}
    assert h.finished[rid].output_token_ids
    h.assert_clean()


def test_a_grant_cut_inside_an_uncuttable_sync_segment_drops_it(harness):
    """A sync stitch is not parked: the given-up blocks go up in the same step, and vLLM
    recomputes from the dropped segment's start."""
    a = script("a", Behaviour(tokens=32))
    lm = script("lm", Behaviour(tokens=120))
    h = harness(
        stitch(native("a"), leaf("lm", load_range="natural_end", load_range_alignment=BLOCK)),
        kv_load_failure_policy="recompute",
    )
    replaying(h)
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.run_until_idle()
    assert allocs(lm, rid)[0] == 0 and allocs(a, rid)[0] == 32
    first = PROMPT - (96 - BLOCK)  # the grant of 96, minus the replayed block
    assert scheduled(h, rid) == first + (PROMPT - 32) + 1
    h.assert_clean()


def test_a_sync_cut_on_several_groups_is_refused(harness):
    """vLLM takes neither invalid blocks (several groups) nor a failed receive (the request
    is not parked) there: no way to give the range up."""
    script("a", Behaviour(tokens=32))
    script("lm", Behaviour(tokens=120))
    h = harness(
        stitch(native("a"), leaf("lm", load_range="natural_end", load_range_alignment=BLOCK)),
        kv_load_failure_policy="recompute",
    )
    replaying(h)
    several_groups(h)
    h.add_request(prompt(PROMPT), max_tokens=2)
    with pytest.raises(LedgerError, match="several KV cache groups"):
        h.step()


@pytest.mark.parametrize("abort", [False, True])
def test_a_nested_stitch_recovers_under_its_parent(harness, abort):
    """A stitch node nested under another node: the parent holds the receive its child held
    back for a recovery, and expects the child's next receive (also after an abort)."""
    _, _, c = failing_middle(Behaviour(tokens=80, is_async=True, load_steps=2))
    inner = chain("tiers", native("a"), native("b"), native("c"), policy="stitch")
    h = harness(kvcompose_config(chain("root", inner)), kv_load_failure_policy="recompute")
    rid = h.add_request(prompt(PROMPT), max_tokens=2).request_id
    h.step()
    assert receives(h, rid) == 0  # held back by the nested node, and by the root
    if abort:
        h.abort(rid)
    h.run_until_idle()
    if not abort:
        assert scheduled(h, rid) == PROMPT - 80 + 1
        assert allocs(c, rid)[:2] == [0, 48]
    assert receives(h, rid) == 1
    assert not h.connector.guard.violations and not h.worker_connector.guard.violations
    h.assert_clean()
