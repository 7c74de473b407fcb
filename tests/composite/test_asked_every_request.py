"""A child that must be asked about every request (``LMCacheMPConnector`` asserts on a request
it was never asked about), or a nested node holding one, is asked by every node whatever the
plan (``Lookup.ask_the_rest``), and told 0 where the plan does not take its hit. On
vLLM's real scheduler with ``kvcompose.testing.lmcache_mp_double``; the engine-level proof is
``tests/lmcache_mp`` against a real ``lmcache server``."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.testing.lmcache_mp_double import lmcache_mp_leaf
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt


# ------------------------------------------------- every node, on vLLM's real scheduler
def route(
    name: str, *children: dict[str, Any], default: str, picks: str = "fast"
) -> dict[str, Any]:
    """A route that sends requests with ``kv_transfer_params["fast"]`` to ``picks``."""
    return {
        "kind": "route",
        "name": name,
        "default": default,
        "rules": [{"child": picks, "param": "fast"}],
        "children": list(children),
    }


def served(h: Any, n: int, seed: int, **kw: Any) -> str:
    request = h.add_request(prompt(n, seed), max_tokens=2, **kw)
    h.run_until_idle()
    assert request.request_id in h.finished
    return request.request_id


def told(s: Any, req_id: str) -> list[int]:
    """The tokens each ``update_state_after_alloc`` told ``s`` for ``req_id``."""
    return [n for n, _ in s.allocations(req_id)]


TREES = {
    # the children after a first hit
    "first": lambda: chain("root", leaf("fast"), lmcache_mp_leaf("lm"), policy="first"),
    # a route's other child
    "route": lambda: route("root", leaf("fast"), lmcache_mp_leaf("lm"), default="lm"),
    # a fan-out's children other than load_from
    "fanout": lambda: {
        "kind": "fanout",
        "name": "root",
        "load_from": "fast",
        "children": [leaf("fast"), lmcache_mp_leaf("lm")],
    },
    # the child after a segment that ends a stitch (a sole owner's: it loads its whole hit)
    "stitch": lambda: chain("root", leaf("fast"), lmcache_mp_leaf("lm"), policy="stitch"),
    # a nested route holding LMCache, after a first chain's hit
    "nested": lambda: chain(
        "root",
        leaf("fast"),
        route("pick", leaf("other"), lmcache_mp_leaf("lm"), default="lm", picks="other"),
        policy="first",
    ),
}


@pytest.mark.parametrize("shape", sorted(TREES))
def test_a_child_asked_about_every_request_is_asked_whatever_the_plan(harness, shape):
    """``LMCacheMPConnector`` asserts in ``update_state_after_alloc`` and
    ``build_connector_meta`` on a request it was never asked about (the engine stops). Each
    node asks it, or the nested node holding it, about every request the plan left it out
    of, takes not its answer and tells it 0: the plan's owner loads, the request finishes."""
    fast = script("fast", Behaviour(tokens=64))
    script("other", Behaviour())
    lm = script("lm", Behaviour(tokens=48, is_async=True))
    h = harness(kvcompose_config(TREES[shape]()))
    req_id = served(h, 65, 1, kv_transfer_params={"fast": True})
    assert told(fast, req_id)[0] == 64
    assert lm.lookups(req_id) >= 1
    assert told(lm, req_id) and set(told(lm, req_id)) == {0}
    h.assert_clean()


def test_a_route_waits_for_an_unchosen_child_still_looking(harness):
    """While the child asked about every request answers ``None`` the decision waits (as
    vLLM's MultiConnector waits for every child), then the chosen child owns."""
    fast = script("fast", Behaviour(tokens=64))
    lm = script("lm", Behaviour(tokens=48, is_async=True, pending_lookups=2))
    h = harness(kvcompose_config(TREES["route"]()))
    req_id = served(h, 80, 3, kv_transfer_params={"fast": True})
    assert lm.lookups(req_id) == 3  # None, None, then its hit (not taken)
    assert fast.lookups(req_id) == 3  # the plan is made again each step it waits
    assert told(fast, req_id)[0] == 64 and set(told(lm, req_id)) == {0}
    h.assert_clean()


def test_a_route_without_such_a_child_asks_only_the_chosen_one(harness):
    """The control: a route over two ordinary children asks only the one its rule picks."""
    fast = script("fast", Behaviour(tokens=64))
    slow = script("slow", Behaviour(tokens=48))
    h = harness(kvcompose_config(route("root", leaf("fast"), leaf("slow"), default="slow")))
    req_id = served(h, 80, 2, kv_transfer_params={"fast": True})
    assert told(fast, req_id)[0] == 64
    assert slow.lookups(req_id) == 0
    h.assert_clean()
