"""vLLM MultiConnector JSON <-> kvcompose documents.

MultiConnector's ``--kv-transfer-config`` is ``{"kv_connector": "MultiConnector", "kv_role":
..., "kv_connector_extra_config": {"connectors": [<child KVTransferConfig>, ...]}}``: a flat
list, first hit loads, every child saves. It becomes a ``chain`` with ``policy: first`` whose
leaves are named after their connectors (``NixlConnector``, ``ExampleConnector``,
``ExampleConnector-2``, ...). A nested MultiConnector child becomes a nested chain.

Going back is possible when the tree is that shape: a ``first`` chain of leaves that all save.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvcompose.config.errors import ConfigError, Path
from kvcompose.config.extra_config import EXTRA_CONFIG
from kvcompose.config.files import Source
from kvcompose.config.messages import LEAF_KEYS
from kvcompose.config.paths import PathMap
from kvcompose.tree import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    KNOWN_KV_TRANSFER_FIELDS,
    OWN_FIELDS,
    TRANSFER_FIELDS,
    Chain,
    Leaf,
    describe,
)
from kvcompose.tree.error_messages import unknown

MULTI = "MultiConnector"
COMPAT_MODULE = "kvcompose.compat"
#: Document keys accepted next to ``connectors`` in the extra config.
EXTRA_KEYS = ("strict", "hma")

_KTC_KEY = "KVTransferConfig key"


def kv_transfer_fields() -> tuple[str, ...]:
    """KVTransferConfig's fields: vLLM's own list when vLLM is imported, else ours."""
    import sys

    module = sys.modules.get("vllm.config.kv_transfer")
    if module is not None:
        try:
            return tuple(f.name for f in dataclasses.fields(module.KVTransferConfig))
        except TypeError:  # pragma: no cover
            pass
    return KNOWN_KV_TRANSFER_FIELDS


def document_from_multiconnector(
    data: Mapping[str, Any], paths: PathMap, src: Source
) -> tuple[dict[str, Any], PathMap]:
    """A kvcompose document from MultiConnector JSON (the whole ``--kv-transfer-config``
    or just its extra config), and where its paths are in the JSON. ``paths`` places the
    JSON in ``src``."""

    prefix: Path = (EXTRA_CONFIG,) if "kv_connector" in data else ()
    back = dataclasses.replace(paths, connectors_at=prefix)

    def fail(path: Path, message: str) -> ConfigError:
        return src.error(back(path), message)

    fields = kv_transfer_fields()
    doc: dict[str, Any] = {}
    if "kv_connector" in data:
        for key in data:
            if key not in fields:
                raise fail((key,), unknown(key, fields, what=_KTC_KEY))
        for key, value in data.items():
            if key not in OWN_FIELDS:
                _put_field(doc, key, value)
        extra = data.get(EXTRA_CONFIG)
        if not isinstance(extra, Mapping) or "connectors" not in extra:
            message = f"expected a mapping with 'connectors', got {describe(extra)}"
            raise src.error(paths(prefix), message)
        allowed = ["connectors", *EXTRA_KEYS]
    else:
        extra = data
        allowed = ["connectors", *EXTRA_KEYS, *TRANSFER_FIELDS, "transfer_config"]
    for key in extra:
        if key not in allowed:
            raise src.error(paths((*prefix, key)), unknown(key, allowed))
        if key != "connectors":  # allowed: a document key
            doc[key] = extra[key]
    doc["tree"] = _chain(extra, fields, fail)
    return doc, back


def _put_field(doc: dict[str, Any], key: str, value: Any) -> None:
    if key in TRANSFER_FIELDS or key in ("transfer_config", *EXTRA_KEYS):
        doc[key] = value
    else:  # a KVTransferConfig field this schema does not know
        doc.setdefault("transfer_config", {})[key] = value


def _chain(extra: Mapping[str, Any], fields: tuple[str, ...], fail: Any) -> dict[str, Any]:
    connectors = extra.get("connectors")
    if not isinstance(connectors, list):
        raise fail(
            ("tree", "chain", "children"),
            f"expected a list of connector configs, got {describe(connectors)}",
        )
    if not connectors:
        raise fail(
            ("tree", "chain", "children"), "is empty: a MultiConnector needs at least one connector"
        )
    children = []
    for index, child in enumerate(connectors):
        here: Path = ("tree", "chain", "children", index, "leaf")
        if not isinstance(child, Mapping):
            raise fail(here[:-1], f"expected a connector config (a mapping), got {describe(child)}")
        for key in child:  # first: a typo explains a missing kv_connector
            if key not in fields:
                raise fail((*here, LEAF_KEYS.get(key, key)), unknown(key, fields, what=_KTC_KEY))
        if "kv_connector" not in child:
            raise fail(here[:-1], "missing required key 'kv_connector'")
        if child.get("kv_connector") == MULTI and child.get("kv_connector_module_path") in (
            None,
            COMPAT_MODULE,
        ):
            nested = child.get(EXTRA_CONFIG)
            if not isinstance(nested, Mapping):
                raise fail(
                    here[:-1], "a nested MultiConnector needs kv_connector_extra_config.connectors"
                )
            sub = _chain(
                nested,
                fields,
                lambda p, m, i=index: fail(("tree", "chain", "children", i, *p[1:]), m),
            )
            children.append(sub)
            continue
        leaf: dict[str, Any] = {}
        for key, value in child.items():
            if key in LEAF_KEYS:
                if value is not None and value != {}:
                    leaf[LEAF_KEYS[key]] = value
            else:
                _put_field(leaf, key, value)
        children.append({"leaf": leaf})
    return {"chain": {"policy": "first", "children": children}}


# --------------------------------------------------------------------------- and back


def multiconnector_from_config(
    config: Any, *, compat: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """vLLM MultiConnector ``--kv-transfer-config`` for a flat tree, and notes.

    ``compat``: load it as ``kvcompose.compat.MultiConnector`` (kvcompose semantics with
    MultiConnector's JSON; per-leaf ``engine_id`` works) instead of vLLM's own class.
    Raises ``ConfigError`` when the tree cannot be expressed.
    """
    tree = config.tree
    target = "kvcompose.compat.MultiConnector" if compat else "vLLM's MultiConnector"
    notes: list[str] = []

    def nope(name: str, why: str) -> ConfigError:
        info = config.nodes.get(name)
        return config.error(info.path if info else (), f"cannot convert to {target}: {why}")

    if not isinstance(tree, Chain) or tree.policy != "first":
        what = f"a {tree.policy!r} chain" if isinstance(tree, Chain) else f"a {tree.kind}"
        raise nope(tree.name, f"the root is {what}; only a 'first' chain of leaves is flat")
    if not compat and tree.lookup_timeout_s != DEFAULT_LOOKUP_TIMEOUT_S:
        raise nope(tree.name, "MultiConnector has no lookup timeout")
    if not tree.save:
        raise nope(tree.name, "MultiConnector always saves")
    top = config.vllm_transfer()
    children = []
    for child in tree.children:
        if not isinstance(child, Leaf):
            raise nope(
                child.name,
                f"{child.kind} {child.name!r} is nested; only leaves are "
                "flat (use kvcompose's KVCompose form)",
            )
        if not child.save:
            raise nope(
                child.name,
                f"leaf {child.name!r} has save: false, but every MultiConnector child saves",
            )
        own = child.transfer_fields()
        if not compat and "engine_id" in own and own.get("engine_id") != top.get("engine_id"):
            raise nope(
                child.name,
                f"leaf {child.name!r} sets its own engine_id, which makes "
                "vLLM's MultiConnector raise TypeError (pass --compat)",
            )
        entry: dict[str, Any] = {"kv_connector": child.connector}
        if child.module_path:
            entry["kv_connector_module_path"] = child.module_path
        # vLLM's MultiConnector does not pass the parent's fields down: spell them out.
        for key, value in own.items():
            if key == "engine_id" and not compat:
                continue  # MultiConnector passes the parent's engine_id itself
            entry[key] = value
        if child.extra_config:
            entry[EXTRA_CONFIG] = dict(child.extra_config)
        if child.on_error != "miss" and not compat:
            notes.append(
                f"leaf {child.name!r}: on_error is a kvcompose setting; "
                "vLLM's MultiConnector lets every error through"
            )
        children.append(entry)
    out: dict[str, Any] = {"kv_connector": MULTI}
    if compat:
        out["kv_connector_module_path"] = COMPAT_MODULE
    out.update(top)
    out[EXTRA_CONFIG] = {"connectors": children}
    if not compat and any(leaf.on_error == "miss" for leaf in tree.children):
        notes.append(
            "vLLM's MultiConnector has no on_error policy: a child's error reaches "
            "vLLM (kvcompose treats it as a miss)"
        )
    return out, notes


def document_notes(data: Mapping[str, Any], doc: Mapping[str, Any]) -> list[str]:
    """What changes when a MultiConnector config is read by kvcompose: children now inherit
    the top-level fields they do not set."""
    notes = []
    extra = data.get(EXTRA_CONFIG) if "kv_connector" in data else data
    top = {k: v for k, v in data.items() if k in TRANSFER_FIELDS and k != "engine_id"}
    if not isinstance(extra, Mapping):
        return notes
    for index, child in enumerate(extra.get("connectors") or ()):
        if not isinstance(child, Mapping):
            continue
        gained = sorted(k for k in top if k not in child)
        if gained:
            name = child.get("kv_connector", f"connectors[{index}]")
            notes.append(
                f"connectors[{index}] ({name}) now inherits "
                + ", ".join(f"{k}={top[k]!r}" for k in gained)
                + " (vLLM's MultiConnector did not pass it down)"
            )
    return notes
