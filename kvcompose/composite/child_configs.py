"""Each child's ``KVTransferConfig`` fields, nested composites included.

A leaf's fields come from ``kvcompose.tree.child_transfer_config`` (inherit what the parent
sets, override with the leaf's own). A nested composite gets the same inherited fields, is
loaded as ``KVCompose`` from module ``kvcompose`` and receives its subtree, validated, under
``TREE_KEY``. Pure dicts, no vLLM import.
"""

from __future__ import annotations

from typing import Any

from kvcompose import tree as nodes

#: The class vLLM loads for a nested composite (``kvcompose.KVCompose``/``KVComposeHMA``).
NESTED_CONNECTOR = "KVCompose"
NESTED_CONNECTOR_HMA = "KVComposeHMA"
NESTED_MODULE = "kvcompose"


def child_transfer_dict(
    parent: Any, node: nodes.Node, *, strict: bool, hma: bool, parent_saves: bool = True
) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields for ``node`` as a child of ``parent`` (a
    ``KVTransferConfig`` or its dict). ``parent_saves``: whether the parent node really
    saves; when it does not, neither does ``node`` (a nested composite's subtree is handed
    down with ``save: false``, so its own leaves are configured not to save either)."""
    saves = parent_saves and node.save
    if isinstance(node, nodes.Leaf):
        return nodes.child_transfer_config(parent, node, saves=saves)
    tree = nodes.dump_node(node)
    if not saves:
        tree["save"] = False
    return {
        **nodes.inherited_fields(parent),
        "kv_connector": NESTED_CONNECTOR_HMA if hma else NESTED_CONNECTOR,
        "kv_connector_module_path": NESTED_MODULE,
        "kv_connector_extra_config": {nodes.TREE_KEY: tree, "strict": strict},
    }
