"""The classes vLLM loads.

``KVCompose`` is the root of a kvcompose tree, loaded with::

    {"kv_connector": "KVCompose", "kv_connector_module_path": "kvcompose",
     "kv_role": "kv_both", "kv_connector_extra_config": {...}}

where the extra config holds a tree (inline, as a file path, or in vLLM MultiConnector's
``{"connectors": [...]}`` form; see ``kvcompose.config``). It is a ``CompositeConnector`` and
nothing more: the same class serves every nested composite node.

vLLM decides HMA support per *class* before any instance exists, so there are two classes:
``KVCompose`` (vLLM turns the hybrid KV cache manager off for it) and ``KVComposeHMA``, for
trees whose children all support HMA (it refuses to start otherwise, naming the child).
"""

from __future__ import annotations

from kvcompose.composite import CompositeConnector, CompositeConnectorHMA


class KVCompose(CompositeConnector):
    """A kvcompose tree as one vLLM KV connector."""


class KVComposeHMA(CompositeConnectorHMA):
    """A kvcompose tree as one vLLM KV connector that supports the hybrid KV cache manager."""


__all__ = ["KVCompose", "KVComposeHMA"]
