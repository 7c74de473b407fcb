"""Route's choice: the one child a route node asks for a request, by its rules.

The first matching rule picks the child; otherwise the default does. Chain and fan-out ask
the same children for every request (``FixedChoice``); a route node's candidates hang on the
request, so its lookups take the general rule (``kvcompose.composite.lookup``) and ``first``
over the one child chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvcompose import tree as nodes
from kvcompose.composite.policies.base import Candidates
from kvcompose.tree import load_predicate, matches

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("kvcompose")


class RouteChoice:
    """A rule that cannot be evaluated for a request (a predicate raising, a
    ``kv_transfer_params`` that is not a dict) does not match; the error is logged once per
    rule."""

    fixed: Candidates | None = None

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
