"""The classes vLLM loads.

``KVCompose`` is the root of a kvcompose tree, loaded with::

    {"kv_connector": "KVCompose", "kv_connector_module_path": "kvcompose",
     "kv_role": "kv_both", "kv_connector_extra_config": {...}}

where the extra config holds a tree (inline, as a file path, or in vLLM MultiConnector's
``{"connectors": [...]}`` form; see ``kvcompose.config``). It is a ``CompositeConnector`` that
also reads user configs: this module sits above both the runtime (``kvcompose.composite``,
which reads only pre-validated trees) and the config reader. The same class serves every
nested composite node, which gets its subtree pre-validated.

vLLM decides HMA support per *class* before any instance exists, so there are two classes:
``KVCompose`` (vLLM turns the hybrid KV cache manager off for it) and ``KVComposeHMA``, for
trees whose children all support HMA (it refuses to start otherwise, naming the child).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvcompose import tree as nodes
from kvcompose.composite.node import CompositeConnector, CompositeConnectorHMA, as_composite


class ReadsUserConfig:
    """Reads the tree through ``kvcompose.config``: a user config in any of its forms, or
    the canonical subtree a parent composite hands down, checked the same way."""

    @classmethod
    def tree_from_config(cls, extra_config: Mapping[str, Any]) -> nodes.Composite:
        # The internal form a parent hands down goes through the same checks (names,
        # references), so a hand-written bad subtree is a ConfigError, not a KeyError later.
        from kvcompose.config import tree_from_extra_config

        return as_composite(tree_from_extra_config(extra_config))


class KVCompose(ReadsUserConfig, CompositeConnector):
    """A kvcompose tree as one vLLM KV connector."""


class KVComposeHMA(ReadsUserConfig, CompositeConnectorHMA):
    """A kvcompose tree as one vLLM KV connector that supports the hybrid KV cache manager."""


__all__ = ["KVCompose", "KVComposeHMA"]
