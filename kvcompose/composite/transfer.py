"""Each child's ``KVTransferConfig`` fields: what it inherits from its composite's config.

Upstream MultiConnector hands each child only what the child's dict says (plus the engine
id), so ``kv_buffer_device``, ``kv_load_failure_policy``, ... silently fall back to vLLM's
defaults. kvcompose children inherit every field the parent sets and override what they set
themselves. A nested composite gets the same inherited fields, is loaded as ``KVCompose``
from module ``kvcompose`` and receives its subtree, pre-validated, under ``TREE_KEY``.

Pure dicts, no vLLM import: the parent may be a plain dict, so config tools use this too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvcompose import spec as specs

#: KVTransferConfig fields that are never inherited: every child sets its own.
OWN_FIELDS: tuple[str, ...] = (
    "kv_connector",
    "kv_connector_module_path",
    "kv_connector_extra_config",
)

#: The class vLLM loads for a nested composite (``kvcompose.KVCompose``/``KVComposeHMA``).
NESTED_CONNECTOR = "KVCompose"
NESTED_CONNECTOR_HMA = "KVComposeHMA"
NESTED_MODULE = "kvcompose"


def transfer_dict(config: Any) -> dict[str, Any]:
    """A ``KVTransferConfig`` (or any dataclass, or a mapping) as a shallow dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    raise TypeError(f"expected a mapping or a KVTransferConfig, got {type(config).__name__}")


def child_transfer_config(parent: Mapping[str, Any] | Any, leaf: specs.LeafSpec) -> dict[str, Any]:
    """The keyword arguments for a leaf's ``KVTransferConfig(**d)``.

    Every field the parent sets (``None`` counts as unset) except ``kv_connector``,
    ``kv_connector_module_path`` and ``kv_connector_extra_config``; then the leaf's
    ``transfer_config`` on top; then the leaf's connector, module path and extra config.
    """
    parent = transfer_dict(parent)
    out = {
        key: value
        for key, value in parent.items()
        if key not in OWN_FIELDS and value is not None and not key.startswith("_")
    }
    for key, value in leaf.transfer_config.items():
        if key not in OWN_FIELDS:
            out[key] = value
    out["kv_connector"] = leaf.connector
    out["kv_connector_module_path"] = leaf.module_path
    out["kv_connector_extra_config"] = dict(leaf.extra_config)
    return out


def child_transfer_dict(
    parent: Any, node: specs.NodeSpec, *, strict: bool, hma: bool
) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields for ``node`` as a child of ``parent`` (a
    ``KVTransferConfig`` or its dict): a leaf's as above, a nested composite's inherited
    fields plus the nested connector and its subtree."""
    if isinstance(node, specs.LeafSpec):
        return child_transfer_config(parent, node)
    inherited = {
        k: v for k, v in transfer_dict(parent).items() if k not in OWN_FIELDS and v is not None
    }
    return {
        **inherited,
        "kv_connector": NESTED_CONNECTOR_HMA if hma else NESTED_CONNECTOR,
        "kv_connector_module_path": NESTED_MODULE,
        "kv_connector_extra_config": {specs.TREE_KEY: specs.to_dict(node), "strict": strict},
    }
