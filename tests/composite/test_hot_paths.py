"""The scheduler half's per-request fast paths keep the general rule's answers, on vLLM's real
scheduler: children that inherit a method from vLLM's ``KVConnectorBase_V1`` are not called for
it (the base's answer is known and changes nothing), the lookup fast path checks every answer
a child has not given before (the guard still sees every malformed one), and it yields to the
general rule for a child taken out of lookups."""

from __future__ import annotations

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
