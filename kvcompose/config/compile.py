"""From a parsed document to a named, checked and resolved tree.

Pydantic checks each node on its own; what needs the whole document is here: default names,
unique names, references to children (route defaults and rules, a fan-out's ``load_from``),
``kv_transfer_params`` producers that would clash, and handing the top-level
``KVTransferConfig`` fields down to the leaves. Every problem is reported at its path in the
document, so the caller can add the file and line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvcompose.config import known
from kvcompose.config.document_form import document_dict
from kvcompose.config.errors import ConfigError, ErrorItem, Path, located, shown_list
from kvcompose.config.messages import items_from_validation
from kvcompose.tree import (
    TRANSFER_FIELDS,
    Chain,
    Document,
    Fanout,
    Leaf,
    Node,
    Route,
    effective_saves,
)
from kvcompose.tree.error_messages import did_you_mean, format_path, shown

Translate = Callable[[Path], Path]

#: ``kv_transfer_params`` keys the P/D connectors vLLM ships put in a finished request.
PD_PARAMS_KEYS = frozenset(
    {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
    }
)
#: Registered connectors known to produce ``kv_transfer_params``.
PARAMS_PRODUCERS: dict[str, frozenset[str]] = {
    name: PD_PARAMS_KEYS
    for name in (
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "MooncakeConnector",
        "MoRIIOConnector",
    )
}


@dataclass(frozen=True)
class NodeInfo:
    """Where a node sits in the document."""

    name: str
    kind: str
    path: Path  # of the node's body, e.g. ("tree", "chain", "children", 1, "leaf")
    parent: str | None
    index: int | None  # position among the parent's children


@dataclass(frozen=True)
class Compiled:
    tree: Node  # named, with the top-level transfer fields on every leaf
    document: dict[str, Any]  # the document form, names filled in
    transfer: dict[str, Any]  # top-level KVTransferConfig fields
    hma: bool | None
    version: int
    nodes: dict[str, NodeInfo]
    warnings: list[str]


@dataclass
class _Placed:
    """A node of the parsed document with its path and name."""

    node: Node
    path: Path
    parent: _Placed | None
    index: int | None
    name: str = ""
    children: list[_Placed] | None = None


def compile_document(
    data: Mapping[str, Any],
    label: str | None,
    linemap: Mapping[Path, int] | None,
    translate: Translate,
) -> Compiled:
    def fail(items: list[ErrorItem]) -> ConfigError:
        return ConfigError([located(linemap, translate(i.path), i.message) for i in items], label)

    try:
        doc = Document.model_validate(dict(data))
    except ValidationError as exc:
        raise fail(items_from_validation(exc)) from None

    root = _place(doc.tree, ("tree", doc.tree.kind), None, None)
    placed = list(_walk(root))
    problems = _check_whole(placed) + _check_known_hma(placed, doc.hma)
    if problems:
        raise fail(problems)

    named = _rebuild(root, {})
    transfer = doc.transfer_fields()
    nodes = {
        p.name: NodeInfo(p.name, p.node.kind, p.path, p.parent.name if p.parent else None, p.index)
        for p in placed
    }
    return Compiled(
        tree=_rebuild(root, transfer),
        document=document_dict(doc, named),
        transfer=transfer,
        hma=None if doc.hma == "auto" else bool(doc.hma),
        version=doc.version,
        nodes=nodes,
        warnings=_warnings(named, placed),
    )


def check_tree(tree: Node) -> list[ErrorItem]:
    """The checks that need the whole tree, for a tree that comes without a document (the
    internal form): unique names, references to children, ``kv_transfer_params`` clashes."""
    return _check_whole(list(_walk(_place(tree, (tree.kind,), None, None))))


def _check_whole(placed: list[_Placed]) -> list[ErrorItem]:
    """Names (default names filled in), references to children, params clashes."""
    return _assign_names(placed) + _check_references(placed) + _check_params(placed)


def _place(node: Node, path: Path, parent: _Placed | None, index: int | None) -> _Placed:
    placed = _Placed(node, path, parent, index)
    if not isinstance(node, Leaf):
        placed.children = [
            _place(child, (*path, "children", i, child.kind), placed, i)
            for i, child in enumerate(node.children)
        ]
    return placed


def _walk(placed: _Placed) -> Iterator[_Placed]:
    yield placed
    for child in placed.children or ():
        yield from _walk(child)


def _rebuild(placed: _Placed, transfer: dict[str, Any]) -> Node:
    """The node with its name, its children rebuilt, and (for a leaf) the inherited
    ``transfer`` fields it does not set itself."""
    update: dict[str, Any] = {"name": placed.name}
    node = placed.node
    if isinstance(node, Leaf):
        for key, value in transfer.items():
            if key in TRANSFER_FIELDS:
                if getattr(node, key) is None:
                    update[key] = value
            elif key not in node.transfer_config:
                update.setdefault("transfer_config", dict(node.transfer_config))[key] = value
    else:
        update["children"] = tuple(_rebuild(c, transfer) for c in placed.children or ())
    return node.model_copy(update=update)


def _assign_names(placed: list[_Placed]) -> list[ErrorItem]:
    problems: list[ErrorItem] = []
    taken: dict[str, Path] = {}
    for p in placed:
        name = p.node.name
        if name is None:
            continue
        if name in taken:
            problems.append(
                ErrorItem(
                    (*p.path, "name"),
                    f"duplicate node name {name!r} (also used at {format_path(taken[name])})",
                )
            )
        else:
            taken[name] = (*p.path, "name")
        p.name = name
    counters: dict[str, int] = {}  # per base name: the last suffix tried (linear, not n^2)
    for p in placed:
        if p.node.name is not None:
            continue
        base = p.node.connector if isinstance(p.node, Leaf) else p.node.kind
        base = "".join(c if c.isalnum() or c in "_-" else "_" for c in base[:56]) or "node"
        name, n = base, counters.get(base, 1)
        if n > 1:
            name = f"{base}-{n}"
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        counters[base] = n
        taken[name] = p.path
        p.name = name
    return problems


def _check_references(placed: list[_Placed]) -> list[ErrorItem]:
    problems: list[ErrorItem] = []
    for p in placed:
        node = p.node
        kids = [c.name for c in p.children or ()]
        known = set(kids)

        def ref(
            value: str,
            path: Path,
            what: str,
            kids: list[str] = kids,
            known: set[str] = known,
            p: _Placed = p,
        ) -> None:
            if value not in known:
                problems.append(
                    ErrorItem(
                        path,
                        f"{what} {shown(value)} is not a child of "
                        f"{p.node.kind} {p.name!r}"
                        f"{did_you_mean(value, kids)} (children: "
                        f"{shown_list(kids)})",
                    )
                )

        if isinstance(node, Route):
            ref(node.default, (*p.path, "default"), "default")
            for i, rule in enumerate(node.rules):
                ref(rule.child, (*p.path, "rules", i, "child"), "rule child")
        elif isinstance(node, Fanout) and node.load_from is not None:
            ref(node.load_from, (*p.path, "load_from"), "load_from")
    return problems


def _params_keys(leaf: Leaf) -> frozenset[str]:
    if leaf.params_keys is not None:
        return frozenset(leaf.params_keys)
    if leaf.module_path is None:
        return PARAMS_PRODUCERS.get(leaf.connector, frozenset())
    return frozenset()


def _check_params(placed: list[_Placed]) -> list[ErrorItem]:
    """At most one leaf per ``kv_transfer_params`` key (linear: each key maps to the first
    leaf that produces it)."""
    owners: dict[str, tuple[int, _Placed, frozenset[str]]] = {}
    for index, p in enumerate(placed):
        if not isinstance(p.node, Leaf) or not (keys := _params_keys(p.node)):
            continue
        clashes = [owners[key] for key in keys if key in owners]
        if clashes:
            _, other, other_keys = min(clashes, key=lambda c: c[0])
            common = sorted(keys & other_keys)
            listed = ", ".join(common[:4]) + (", ..." if len(common) > 4 else "")
            return [
                ErrorItem(
                    p.path,
                    f"{p.name!r} ({p.node.connector}) and "
                    f"{other.name!r} ({other.node.connector}) would both "  # type: ignore[union-attr]
                    f"produce kv_transfer_params keys ({listed}): at most one "
                    "leaf may produce each key (set 'params_keys: []' on a leaf "
                    "that produces none)",
                )
            ]
        for key in keys:
            owners[key] = (index, p, keys)
    return []


def _check_known_hma(placed: list[_Placed], hma: Any) -> list[ErrorItem]:
    """``hma: true`` with a leaf known not to support HMA fails here, without vLLM."""
    if hma is not True:
        return []
    return [
        ErrorItem((*p.path, "connector"), known.no_hma(p.node.connector))
        for p in placed
        if isinstance(p.node, Leaf)
        and (facts := known.known(p.node)) is not None
        and not facts.supports_hma
    ]


def _warnings(tree: Node, placed: list[_Placed]) -> list[str]:
    out: list[str] = []
    out.extend(known.tree_warnings(tree))
    if not any(saves for _, saves in effective_saves(tree)):
        out.append("no leaf saves: this tree never stores KV caches")
    for p in placed:
        if isinstance(p.node, Chain) and len(p.node.children) == 1:
            out.append(f"{format_path(p.path)}: chain {p.name!r} has a single child")
    return out
