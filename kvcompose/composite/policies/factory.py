"""Policy name → class, one registration per policy, and a node's policy built from its tree.

A chain's ``policy`` names its class; fan-out and route nodes take ``first`` over the
candidates they choose (fan-out: ``load_from`` or none; route: its rules). Adding a policy is
one module with a ``LookupPolicy`` subclass and one line in ``POLICIES`` (and the name in the
tree's ``Chain.policy``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcompose import tree as nodes
from kvcompose.composite.policies.base import (
    Candidates,
    ChildChoice,
    FixedChoice,
    LookupPolicy,
    PolicySetting,
)
from kvcompose.composite.policies.fastest.policy import FastestLookup
from kvcompose.composite.policies.first_longest import FirstLookup, LongestLookup
from kvcompose.composite.policies.route import RouteChoice
from kvcompose.composite.policies.stitch import StitchLookup
from kvcompose.tree.ranges import RangeSupport, known_range_support

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvcompose.composite.ledger import Ledger
    from kvcompose.composite.stats import NodeCounters

#: Every policy, by the name a chain's ``policy`` gives.
POLICIES: dict[str, type[LookupPolicy]] = {
    cls.name: cls for cls in (FirstLookup, LongestLookup, StitchLookup, FastestLookup)
}


def policy_name(tree: nodes.Composite) -> str:
    return tree.policy if isinstance(tree, nodes.Chain) else FirstLookup.name


def policy_class(tree: nodes.Composite) -> type[LookupPolicy]:
    """The class of ``tree``'s lookup policy (what it is, before it is built)."""
    return POLICIES[policy_name(tree)]


def child_choice(tree: nodes.Composite) -> ChildChoice:
    """Which children the node asks: chain every one, fan-out its ``load_from``, route by
    rule."""
    index = {child.name: i for i, child in enumerate(tree.children)}
    if isinstance(tree, nodes.Chain):
        all_children = tuple(range(len(tree.children)))
        return FixedChoice(Candidates(all_children, f"chain/{tree.policy}"))
    if isinstance(tree, nodes.Fanout):
        children = () if tree.load_from is None else (index[tree.load_from],)
        return FixedChoice(Candidates(children, f"fan-out/load_from={tree.load_from}"))
    if isinstance(tree, nodes.Route):
        return RouteChoice(tree.rules, index, tree.default)
    raise TypeError(f"not a composite node: {tree!r}")


def child_range_supports(tree: nodes.Composite) -> tuple[RangeSupport, ...]:
    """Each child's range support: a leaf's from its connector class and overrides, a nested
    composite as one owner."""
    return tuple(
        child.range_support() if isinstance(child, nodes.Leaf) else known_range_support(None)
        for child in tree.children
    )


#: Connectors that must be asked about every request they see: ``LMCacheMPConnector`` makes a
#: request's tracker in ``get_num_new_matched_tokens``, and its ``update_state_after_alloc``
#: and ``build_connector_meta`` assert on a request it was never asked about.
ASKED_ABOUT_EVERY_REQUEST = frozenset({"LMCacheMPConnector"})


def holds_asked_every_request(node: nodes.Node) -> bool:
    """Whether ``node`` is, or holds, a leaf of ``ASKED_ABOUT_EVERY_REQUEST``: a nested node
    holding one must see every request too, to ask it."""
    if isinstance(node, nodes.Leaf):
        return node.connector in ASKED_ABOUT_EVERY_REQUEST
    return any(holds_asked_every_request(child) for child in node.children)


def asked_every_request(tree: nodes.Composite) -> frozenset[int]:
    """The children of ``tree`` that must be asked about every request, whatever the plan
    (``Lookup.ask_the_rest``)."""
    return frozenset(i for i, c in enumerate(tree.children) if holds_asked_every_request(c))


def build_policy(
    tree: nodes.Composite,
    block_size: int,
    ledger: Ledger,
    counters: NodeCounters,
    *,
    ask_every_child: bool = False,
    vllm_config: VllmConfig | None = None,
) -> LookupPolicy:
    """The lookup policy of the node ``tree``."""
    setting = PolicySetting(
        tree,
        child_choice(tree),
        child_range_supports(tree),
        block_size,
        ledger,
        counters,
        ask_every_child=ask_every_child,
        vllm_config=vllm_config,
    )
    return policy_class(tree)(setting)
