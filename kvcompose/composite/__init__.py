"""The runtime: a composite node of a kvcompose tree, itself a vLLM KV connector.

Split by role like vLLM's larger connectors:

- ``node``: ``CompositeConnector`` / ``CompositeConnectorHMA``, the facade vLLM calls; it
  builds the children and the half its role needs, and forwards every connector member;
- ``scheduler``: the scheduler half (lookup policy, ownership ledger, per-step loads and sends,
  finish accounting); ``ledger``: its per-request state machines; ``lookup``: asking the
  children, guarding and recording; ``policies``: what a lookup policy decides (first,
  longest, stitch, fastest; route's choice); ``output_routing``: each child's view of a
  step's output;
- ``worker``: the worker half (owner-filtered completion signals, per-child failure
  containment);
- ``children`` (building and calling children), ``child_configs`` (each child's
  ``KVTransferConfig`` fields), ``params_merge`` (their ``kv_transfer_params`` in one dict),
  ``guard`` (contract checks), ``metadata`` (what the halves
  ship each other), ``stats`` (counters and metrics), ``rules`` (the aggregation rule of
  every member).

The runtime reads trees in their validated in-memory form (``kvcompose.tree``); reading user
documents is the config layer's job (``kvcompose.config``), and ``kvcompose.KVCompose`` joins
the two. Importing this package does not import vLLM; its modules other than ``child_configs``,
``ledger``, ``guard``, ``policies`` and ``rules`` do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompositeConnector", "CompositeConnectorHMA"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvcompose.composite import node

        return getattr(node, name)
    raise AttributeError(f"module 'kvcompose.composite' has no attribute {name!r}")
