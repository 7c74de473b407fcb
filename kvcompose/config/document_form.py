"""Dumping trees and documents in the user's document form (one key per node, its kind).

The canonical ``kind`` form (``kvcompose.tree.dump_node``) is what kvcompose hands itself;
people read and write the document form, so ``explain``, ``convert`` and overrides use this.
Both come from the same pydantic dump: only the node spelling differs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvcompose.tree import NODE_KINDS, TRANSFER_FIELDS, VERSION, Document, Leaf, Node, dump_node


def document_form(canonical: dict[str, Any]) -> dict[str, Any]:
    """A canonical node dict (``{"kind": ..., ...}``) in the document form."""
    body = {k: v for k, v in canonical.items() if k != "kind"}
    if "children" in body:
        body["children"] = [document_form(child) for child in body["children"]]
    return {canonical["kind"]: body}


def node_bodies(tree: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, body) of every node of a tree in the document form, parents first."""
    if not isinstance(tree, dict):
        return
    for kind in NODE_KINDS:
        body = tree.get(kind)
        if isinstance(body, dict):
            yield kind, body
            for child in body.get("children") or ():
                yield from node_bodies(child)


def document_dict(doc: Document, tree: Node | None = None) -> dict[str, Any]:
    """``doc`` as a plain dict in the document form (``tree`` replaces its tree, e.g. with
    names filled in); only what was set, plus the version."""
    out: dict[str, Any] = {"version": doc.version}
    out.update(doc.model_dump(mode="json", exclude_unset=True, exclude={"tree", "version"}))
    out["tree"] = document_form(dump_node(tree if tree is not None else doc.tree))
    return out


def document_from_tree(tree: Node, transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    """A document for a tree that was handed over in the canonical form: the top-level
    ``transfer`` fields go to the top, and leaf fields that merely repeat them are left to
    inheritance."""
    transfer = dict(transfer or {})
    top = {key: transfer.pop(key) for key in TRANSFER_FIELDS if key in transfer}
    if transfer:
        top["transfer_config"] = transfer
    doc = Document.model_validate({"tree": dump_node(tree), **top})
    inherited = doc.transfer_fields()
    return document_dict(doc, _without_inherited(tree, inherited))


_UNSET = object()


def _without_inherited(node: Node, inherited: dict[str, Any]) -> Node:
    if isinstance(node, Leaf):
        own = {k: v for k, v in node.transfer_config.items() if inherited.get(k, _UNSET) != v}
        dropped = {
            key
            for key in TRANSFER_FIELDS
            if key in inherited and getattr(node, key) == inherited[key]
        }
        data = dump_node(node)
        for key in dropped:
            data.pop(key, None)
        if own:
            data["transfer_config"] = own
        else:
            data.pop("transfer_config", None)
        return Leaf.model_validate(data)
    children = tuple(_without_inherited(child, inherited) for child in node.children)
    return node.model_copy(update={"children": children})


__all__ = ["VERSION", "document_dict", "document_form", "document_from_tree", "node_bodies"]
