"""Helpers of the ``policy: stitch`` tests on vLLM's real scheduler, with scripted children.

A scripted child is told ``load_range: native`` (the table puts unknown connectors at
``sole_owner``): it holds the prompt's first ``tokens`` tokens, answers what it holds after
the lookup's argument, and loads the blocks from that argument on, as kvcompose's store and
vLLM's OffloadingConnector do.
"""

from __future__ import annotations

from typing import Any

from kvcompose.testing.scripted import leaf
from kvcompose.testing.trees import chain, kvcompose_config

BLOCK = 16


def native(name: str, **fields: Any) -> dict[str, Any]:
    return leaf(name, load_range="native", **fields)


def stitch_config(*children: Any, **fields: Any) -> dict[str, Any]:
    return kvcompose_config(chain("root", *children, policy="stitch"), **fields)


def allocs(s: Any, req_id: str) -> list[int]:
    """The token counts the child was allocated for the request, in order."""
    return [n for n, _ in s.allocations(req_id)]


def lookups_at(s: Any, req_id: str) -> list[int]:
    """Where the child was looked up for the request (the lookups' arguments), in order."""
    return [c[2] for c in s.calls if c[0] == "lookup" and c[1] == req_id]


def scheduled_per_step(h: Any, req_id: str) -> list[int]:
    """Tokens vLLM scheduled for the request, step by step."""
    return [r.scheduler_output.num_scheduled_tokens.get(req_id, 0) for r in h.history]


def scheduled(h: Any, req_id: str) -> int:
    """Tokens vLLM computed for the request, over every step."""
    return sum(scheduled_per_step(h, req_id))


def receives(h: Any, req_id: str) -> int:
    """Steps whose output showed vLLM a finished_recving for the request."""
    return sum(req_id in (r.kv_connector_output.finished_recving or ()) for r in h.history)
