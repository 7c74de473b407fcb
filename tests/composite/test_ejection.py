"""Outlier ejection on vLLM's real scheduler: a child whose calls fail (raise, answer slowly,
or are still looking at the lookup deadline) ``failures`` times in a row is skipped in
lookups for its back-off window, asked once again after it, and let back in when it answers
in time (``kvcompose.composite.outliers``).

The failing children are scripted connectors (``kvcompose.testing.scripted``); a slow one is
the scripted child's lookup with the guard's clock moved on inside it, as a lookup waiting on
a dead server's RPC timeout holds ``Scheduler.schedule``. The guard's clock is the test's, so
no assertion depends on how fast the machine runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.composite.stats import PROM_COUNTERS, split_counter
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

RAISE = frozenset({"get_num_new_matched_tokens"})


class Clock:
    """The guard's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ejecting_harness(harness, *children: dict[str, Any], **chain_fields: Any) -> tuple[Any, Clock]:
    h = harness(kvcompose_config(chain("root", *children, **chain_fields)))
    clock = Clock()
    h.connector.guard.disabled.clock = clock
    return h, clock


def serve(h, seed: int) -> str:
    """One request through the scheduler, to its end; its id."""
    req = h.add_request(prompt(40, seed), max_tokens=1)
    h.run_until_idle()
    return req.request_id


def counters(h) -> dict[str, float]:
    return dict(h.connector.counters.totals)


def test_a_failing_child_is_ejected_skipped_during_backoff_and_let_back_after(harness):
    a = script("a", Behaviour(tokens=32, raise_in=RAISE))
    b = script("b", Behaviour(tokens=16))
    rule = {"failures": 2, "backoff_s": 10}
    h, clock = ejecting_harness(harness, leaf("a", eject=rule), leaf("b"))

    first = [serve(h, seed) for seed in (1, 2)]
    assert [a.lookups(r) for r in first] == [1, 1]
    assert counters(h).get("ejections.a") == 1, "ejected after the rule's 2 failures"

    during = [serve(h, seed) for seed in (3, 4, 5)]
    assert [a.lookups(r) for r in during] == [0, 0, 0], "skipped during the back-off"
    assert [b.lookups(r) for r in during] == [1, 1, 1]
    assert counters(h).get("ejected_lookups.a") == 3
    assert all(a.finished[r] == 1 for r in first + during), "it still hears every finish"
    assert all(len(a.allocations(r)) == 1 for r in during), "...and every allocation"

    clock.now += 10  # the back-off is over; a answers again
    a.default = Behaviour(tokens=32)
    after = serve(h, 6)
    assert a.lookups(after) == 1, "asked once again after the back-off"
    assert h.connector.counters.totals.get("hit_tokens.a") == 32
    assert counters(h).get("readmissions.a") == 1
    assert not h.connector.guard.disabled, "back in: nothing is out of lookups"
    assert a.lookups(serve(h, 7)) == 1
    h.assert_clean()


def slow_lookups(h, child: int, clock: Clock, seconds: float) -> None:
    """The child's lookups take ``seconds`` on the guard's clock (its client waits on a dead
    server; the answer still comes)."""
    connector = h.connector.children.connectors[child]
    ask = connector.get_num_new_matched_tokens

    def slow(request: Any, num_computed_tokens: int) -> Any:
        clock.now += seconds
        return ask(request, num_computed_tokens)

    connector.get_num_new_matched_tokens = slow
    h.connector.refresh_child_methods()


def test_a_slow_child_is_ejected_and_a_failed_trial_doubles_its_backoff(harness):
    a = script("a", Behaviour(tokens=32))
    script("b", Behaviour(tokens=16))
    rule = {"failures": 1, "slow_ms": 500, "backoff_s": 10}
    h, clock = ejecting_harness(harness, leaf("a", eject=rule), leaf("b"))
    slow_lookups(h, 0, clock, 4.0)

    r0 = serve(h, 1)
    assert a.lookups(r0) == 1 and counters(h).get("hit_tokens.a") == 32, "its answer is used"
    assert counters(h).get("slow_lookups.a") == 1
    assert counters(h).get("ejections.a") == 1
    assert a.lookups(serve(h, 2)) == 0

    clock.now += 10  # the trial: slow again, so ejected for twice as long
    assert a.lookups(serve(h, 3)) == 1
    assert counters(h).get("ejections.a") == 2
    clock.now += 10
    assert a.lookups(serve(h, 4)) == 0, "the second back-off is 20 s"
    clock.now += 10
    assert a.lookups(serve(h, 5)) == 1
    h.assert_clean()


def test_still_looking_at_the_lookup_deadline_counts_as_a_failure(harness):
    a = script("a", Behaviour(tokens=32, pending_lookups=10**6))
    b = script("b", Behaviour(tokens=16))
    h, _ = ejecting_harness(
        harness,
        leaf("a", eject={"failures": 1, "backoff_s": 60}),
        leaf("b"),
        policy="longest",
        lookup_timeout_s=1e-9,  # the deadline passes by the next step
    )
    r0 = serve(h, 1)
    assert a.lookups(r0) >= 1 and counters(h).get("lookup_timeouts.a") == 1
    assert counters(h).get("ejections.a") == 1
    r1 = serve(h, 2)
    assert a.lookups(r1) == 0 and b.lookups(r1) == 1
    h.assert_clean()


def test_without_a_rule_a_failing_child_is_asked_every_time(harness):
    """The contrast: the same failures without ``eject`` (fewer than the errors that take a
    child out for good) cost a lookup every request."""
    a = script("a", Behaviour(tokens=32, raise_in=RAISE))
    script("b", Behaviour(tokens=16))
    h, _ = ejecting_harness(harness, leaf("a"), leaf("b"))
    reqs = [serve(h, seed) for seed in range(4)]
    assert [a.lookups(r) for r in reqs] == [1, 1, 1, 1]
    assert "ejections.a" not in counters(h)
    h.assert_clean()


@pytest.mark.parametrize(
    "key", ["ejections.a", "ejected_lookups.a", "slow_lookups.a", "readmissions.a"]
)
def test_ejection_counters_are_prometheus_counters_by_child(key):
    prefix, labels = split_counter(key)
    assert labels == ("a",)
    assert prefix in {p for p, *_ in PROM_COUNTERS}
