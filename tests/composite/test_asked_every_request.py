"""A ``first`` chain asks every child when one of them must be asked about every request
(``LMCacheMPConnector`` asserts on a request it was never asked about); the first hit still
owns. The engine-level proof is ``tests/lmcache_mp`` (``first [store, lmcache]``)."""

from __future__ import annotations

import pytest

from kvcompose import tree as nodes
from kvcompose.composite.ledger import Ledger
from kvcompose.composite.policies.factory import build_policy
from kvcompose.composite.stats import NodeCounters


def first_chain(*connectors: str) -> nodes.Chain:
    children = [{"kind": "leaf", "name": f"c{i}", "connector": c} for i, c in enumerate(connectors)]
    tree = nodes.parse_node(
        {"kind": "chain", "name": "root", "policy": "first", "children": children}
    )
    assert isinstance(tree, nodes.Chain)
    return tree


@pytest.mark.parametrize(
    ("connectors", "stops"),
    [
        (("ExampleConnector", "NixlConnector"), True),
        (("ExampleConnector", "LMCacheMPConnector"), False),
        (("LMCacheMPConnector", "ExampleConnector"), False),
    ],
)
def test_first_asks_past_its_hit_only_for_a_child_asked_about_every_request(connectors, stops):
    tree = first_chain(*connectors)
    policy = build_policy(tree, 16, Ledger(), NodeCounters([c.name for c in tree.children]))
    assert policy.stops_at_hit is stops
