"""Small builders for kvcompose trees in tests (canonical dict form, see ``kvcompose.tree``)."""

from __future__ import annotations

from typing import Any

from kvcompose.tree import TREE_KEY


def kvcompose_config(
    tree: dict[str, Any], *, strict: bool = False, **fields: Any
) -> dict[str, Any]:
    """A ``KVTransferConfig`` dict loading ``tree`` as the root ``KVCompose`` connector."""
    return {
        "kv_connector": "KVCompose",
        "kv_connector_module_path": "kvcompose",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {TREE_KEY: tree, "strict": strict},
        **fields,
    }


def multiconnector_config(*leaves: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """vLLM's own MultiConnector over the same leaves (the upstream baseline)."""
    children = []
    for leaf in leaves:
        child = {
            "kv_connector": leaf["connector"],
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(leaf.get("extra_config", {})),
        }
        if leaf.get("module_path"):
            child["kv_connector_module_path"] = leaf["module_path"]
        children.append(child)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": children},
        **fields,
    }


def example_leaf(name: str, path: Any, **fields: Any) -> dict[str, Any]:
    """A leaf running vLLM's ExampleConnector (whole-prompt disk store) under ``path``."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "ExampleConnector",
        "extra_config": {"shared_storage_path": str(path)},
        **fields,
    }


def prefix_store_leaf(
    name: str, path: Any, *, fields: dict[str, Any] | None = None, **extra_config: Any
) -> dict[str, Any]:
    """A leaf running kvcompose's PrefixStoreConnector under ``path`` (``extra_config``
    keywords such as ``load_mode="async"`` go to the store; ``fields`` to the node)."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "PrefixStoreConnector",
        "module_path": "kvcompose.stores",
        "extra_config": {"path": str(path), **extra_config},
        **(fields or {}),
    }


def chain(
    name: str, *children: dict[str, Any], policy: str = "first", **fields: Any
) -> dict[str, Any]:
    return {"kind": "chain", "name": name, "policy": policy, "children": list(children), **fields}


def prompt(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    """A deterministic prompt of ``n`` token ids; different seeds share no prefix."""
    return [(seed * 7919 + i * 31 + seed) % (vocab - 4) + 4 for i in range(n)]


def predicate_reading_params(request: Any) -> bool:
    """A route predicate (``kvcompose.testing.trees:predicate_reading_params``) that trusts
    the request's ``kv_transfer_params`` to hold an int ``"priority"``: it raises on requests
    without one, as careless user predicates do."""
    return int(request.kv_transfer_params["priority"]) > 5
