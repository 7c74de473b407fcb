"""Lookup policies: which children a node asks, in what order, and how it picks the owner.

Chain, fan-out and route differ only here. A policy names the *candidates* for a request
(children to ask, in order) and a *mode*:

- ``first``: ask in order, stop at the first hit; a child still answering ``None`` ahead of
  it holds the decision until it answers or the node's lookup deadline passes;
- ``longest``: ask every candidate, the largest count wins, ties go to the earlier child;
- ``stitch``: ask in order, each child at the end of what the earlier ones cover, every hit
  a segment of one stitched load (``kvcompose.composite.stitch``);
- ``fastest``: ask every candidate, and take the plan (recompute, one load, or a stitch)
  with the least predicted time to first token (``kvcompose.composite.fastest``).

Route asks exactly one child (chosen by its rules), fan-out one designated child or none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvcompose import tree as nodes
from kvcompose.tree import load_predicate, matches

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvcompose")

Mode = Literal["first", "longest", "stitch", "fastest"]


@dataclass(frozen=True)
class Candidates:
    children: tuple[int, ...]
    reason: str


class LookupPolicy:
    mode: Mode = "first"

    def candidates(self, request: Request) -> Candidates:
        raise NotImplementedError


class ChainLookup(LookupPolicy):
    def __init__(self, num_children: int, mode: Mode) -> None:
        self.mode = mode
        self._all = Candidates(tuple(range(num_children)), f"chain/{mode}")

    def candidates(self, request: Request) -> Candidates:
        return self._all


class FanoutLookup(LookupPolicy):
    def __init__(self, load_from: int | None, load_from_name: str | None) -> None:
        children = () if load_from is None else (load_from,)
        self._candidates = Candidates(children, f"fan-out/load_from={load_from_name}")

    def candidates(self, request: Request) -> Candidates:
        return self._candidates


class RouteLookup(LookupPolicy):
    """The first matching rule picks the child; otherwise the default does.

    A rule that cannot be evaluated for a request (a predicate raising, a ``kv_transfer_params``
    that is not a dict) does not match; the error is logged once per rule.
    """

    def __init__(self, rules: tuple[nodes.RouteRule, ...], index: Mapping[str, int], default: str):
        self._rules = [(rule, index[rule.child], load_predicate(rule.predicate)) for rule in rules]
        self._default = Candidates((index[default],), f"route/default→{default}")
        self._reasons = [
            Candidates((i,), f"route/rule{n}→{rule.child}")
            for n, (rule, i, _) in enumerate(self._rules)
        ]
        self._broken: set[int] = set()

    def candidates(self, request: Request) -> Candidates:
        for n, (rule, _, predicate) in enumerate(self._rules):
            try:
                if matches(rule, predicate, request):
                    return self._reasons[n]
            except Exception as exc:  # a user predicate or malformed params
                if n not in self._broken:
                    self._broken.add(n)
                    logger.error(
                        "kvcompose route rule %d (→%s) failed on request %s: %s; "
                        "treated as no match (logged once per rule)",
                        n,
                        rule.child,
                        request.request_id,
                        exc,
                    )
        return self._default


def policy_for(spec: nodes.Composite) -> LookupPolicy:
    index = {child.name: i for i, child in enumerate(spec.children)}
    if isinstance(spec, nodes.Chain):
        return ChainLookup(len(spec.children), spec.policy)
    if isinstance(spec, nodes.Fanout):
        load_from = None if spec.load_from is None else index[spec.load_from]
        return FanoutLookup(load_from, spec.load_from)
    if isinstance(spec, nodes.Route):
        return RouteLookup(spec.rules, index, spec.default)
    raise TypeError(f"not a composite node: {spec!r}")
