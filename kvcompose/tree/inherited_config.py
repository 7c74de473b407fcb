"""Per-child ``KVTransferConfig`` dicts: what a leaf inherits from its parent's config.

Upstream MultiConnector hands each child only what the child's dict says (plus the engine
id), so ``kv_buffer_device``, ``kv_load_failure_policy``, ... silently fall back to vLLM's
defaults. kvcompose children inherit every field the parent sets and override what they set
themselves. No vLLM import: the parent may be a plain dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvcompose.tree.fields import OWN_FIELDS
from kvcompose.tree.model import Leaf
from kvcompose.tree.saves_off import without_saves


def transfer_dict(config: Any) -> dict[str, Any]:
    """A ``KVTransferConfig`` (or any dataclass, or a mapping) as a shallow dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    raise TypeError(f"expected a mapping or a KVTransferConfig, got {type(config).__name__}")


def inherited_fields(parent: Mapping[str, Any] | Any) -> dict[str, Any]:
    """Every field the parent sets (``None`` counts as unset) except the connector's own."""
    return {
        key: value
        for key, value in transfer_dict(parent).items()
        if key not in OWN_FIELDS and value is not None and not key.startswith("_")
    }


def child_transfer_config(
    parent: Mapping[str, Any] | Any, leaf: Leaf, *, saves: bool = True
) -> dict[str, Any]:
    """The keyword arguments for the leaf's ``KVTransferConfig(**d)``: the parent's
    inherited fields, the leaf's own fields on top, then its connector, module path and
    extra config. ``saves``: whether the leaf really saves (its ``save`` and every
    ancestor's); when not, ``kvcompose.tree.saves_off`` keeps its connector from planning
    saves (or refuses, raising ``ValueError``)."""
    out = inherited_fields(parent)
    out.update(leaf.transfer_fields())
    out["kv_connector"] = leaf.connector
    out["kv_connector_module_path"] = leaf.module_path
    out["kv_connector_extra_config"] = dict(leaf.extra_config)
    return out if saves else without_saves(out)
