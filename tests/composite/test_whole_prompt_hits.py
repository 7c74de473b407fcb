"""A sync hit that covers the whole prompt, on vLLM's real scheduler: vLLM needs one token to
compute after a sync load (``Scheduler.schedule`` asserts ``num_new_tokens > 0``), so the
guard cuts such an answer back, counts it as a contract fix and logs it once per child. An
async hit may cover the whole prompt: vLLM recomputes the last token after the receive."""

from __future__ import annotations

import logging

from stitch_helpers import BLOCK, allocs, native, scheduled_per_step, stitch_config

from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt


def violations(h, child: str) -> int:
    return h.connector.guard.violations[(child, "whole_prompt_sync")]


def test_a_sync_child_answering_every_prompt_token_is_cut_to_leave_one(harness, caplog):
    """A child that can be cut short loads all but the last token; one that cannot (an
    unknown connector, ``sole_owner``) is cut to the last whole block before it."""
    s = script("s", Behaviour(tokens=80, break_whole_prompt=True))
    n = script("n", Behaviour(tokens=80, break_whole_prompt=True))
    h = harness(kvcompose_config(chain("root", leaf("s"), policy="first")))
    whole = h.add_request(prompt(80, 1), max_tokens=2, request_id="whole")
    h.run_until_idle()
    assert allocs(s, whole.request_id) == [80 - BLOCK]  # 80 held, cut to 64
    assert scheduled_per_step(h, whole.request_id)[0] == BLOCK

    h2 = harness(kvcompose_config(chain("root2", native("n"), policy="first")))
    again = h2.add_request(prompt(80, 2), max_tokens=2, request_id="again")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcompose"):
        h2.run_until_idle()
        third = h2.add_request(prompt(80, 3), max_tokens=2, request_id="third")
        h2.run_until_idle()
    assert allocs(n, again.request_id) == [79]  # a native child is cut to the last token
    assert scheduled_per_step(h2, again.request_id)[0] == 1
    assert allocs(n, third.request_id) == [79]
    assert violations(h, "s") == 1 and violations(h2, "n") == 2
    assert sum("whole_prompt_sync" in r.getMessage() for r in caplog.records) == 1  # once
    h.assert_clean()
    h2.assert_clean()


def test_a_stitch_whose_last_sync_segment_reaches_the_end_is_cut(harness):
    """fast holds 64, slow the whole 200-token prompt: slow's segment from 64 is cut to 135."""
    fast = script("fast", Behaviour(tokens=64))
    slow = script("slow", Behaviour(tokens=200, break_whole_prompt=True))
    h = harness(stitch_config(native("fast"), native("slow")))
    req = h.add_request(prompt(200, 4), max_tokens=2)
    h.run_until_idle()
    assert allocs(fast, req.request_id) == [64]
    assert allocs(slow, req.request_id) == [135]
    assert scheduled_per_step(h, req.request_id)[0] == 1
    assert violations(h, "slow") == 1
    h.assert_clean()


def test_an_async_hit_of_the_whole_prompt_is_taken_as_is(harness):
    a = script("a", Behaviour(tokens=80, is_async=True, break_whole_prompt=True))
    h = harness(kvcompose_config(chain("root", native("a"))))
    req = h.add_request(prompt(80, 5), max_tokens=2)
    h.run_until_idle()
    assert allocs(a, req.request_id)[0] == 80
    assert violations(h, "a") == 0
    h.assert_clean()
