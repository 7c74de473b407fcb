"""Writing configs out: vLLM arguments and YAML documents."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

import yaml

from kvcompose.config.document_form import document_from_tree, node_bodies
from kvcompose.config.errors import ConfigError
from kvcompose.config.load import Config
from kvcompose.tree import TRANSFER_FIELDS, VERSION

#: How vLLM loads the composite (``kvcompose`` resolves the class lazily).
MODULE_PATH = "kvcompose"


def composite_class(config: Config) -> str:
    """``KVComposeHMA`` when HMA is required, or wanted and every leaf supports it (known only
    when vLLM was checked); else ``KVCompose``, for which vLLM turns HMA off."""
    if config.hma is True:
        return "KVComposeHMA"
    if config.hma is None and config.facts is not None and config.facts.all_hma:
        return "KVComposeHMA"
    return "KVCompose"


def vllm_args(config: Config, *, by_path: bool = False, module_path: bool = True) -> dict[str, Any]:
    """The ``--kv-transfer-config`` dict that loads ``config`` as a KVCompose connector.

    The tree goes inline (``{"version": 1, "tree": ...}``), or with ``by_path`` as
    ``{"config": "/abs/path.yaml"}`` (the file must then exist where vLLM runs). Top-level
    KVTransferConfig fields go to the top of the vLLM config, where leaves inherit them.
    ``module_path=False`` omits ``kv_connector_module_path`` (relies on the vLLM plugin).
    """
    transfer = config.vllm_transfer()
    out: dict[str, Any] = {"kv_connector": composite_class(config)}
    if module_path:
        out["kv_connector_module_path"] = MODULE_PATH
    for key in TRANSFER_FIELDS:
        if key in transfer:
            out[key] = transfer.pop(key)
    out.update(transfer)  # fields from transfer_config
    document = config.document or document_from_tree(config.tree)
    if by_path:
        if not config.path:
            raise ConfigError(
                "this config does not come from a file: print it inline", config.label
            )
        extra: dict[str, Any] = {"config": os.path.abspath(config.path)}
    else:
        extra = {"version": document.get("version", VERSION)}
        if "hma" in document:
            extra["hma"] = document["hma"]
    if document.get("strict"):
        extra["strict"] = True
    if not by_path:
        extra["tree"] = document["tree"]
    out["kv_connector_extra_config"] = extra
    return out


def to_json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=False)


def shell_arg(data: dict[str, Any]) -> str:
    return f"--kv-transfer-config {shlex.quote(to_json(data))}"


def python_form(data: dict[str, Any]) -> str:
    """``KVTransferConfig(...)`` source text for the same config."""
    args = ",\n".join(f"    {key}={_pyjson(value, 4)}" for key, value in data.items())
    return (
        "from vllm.config import KVTransferConfig\n\n"
        f"kv_transfer_config = KVTransferConfig(\n{args},\n)"
    )


def _pyjson(value: Any, indent: int) -> str:
    pad = " " * (indent + 4)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = ",\n".join(f"{pad}{k!r}: {_pyjson(v, indent + 4)}" for k, v in value.items())
        return "{\n" + items + ",\n" + " " * indent + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        items = ",\n".join(f"{pad}{_pyjson(v, indent + 4)}" for v in value)
        return "[\n" + items + ",\n" + " " * indent + "]"
    return repr(value)


class _Dumper(yaml.SafeDumper):
    """Block style, with list items indented under their key."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> yaml.Node:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items())


_Dumper.add_representer(dict, _represent_dict)


def to_yaml(data: Any, header: str | None = None) -> str:
    text = yaml.dump(
        data,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    if header:
        text = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + text
    return text


def simplify_document(document: dict[str, Any]) -> dict[str, Any]:
    """The same document with leaf fields that merely repeat the top level removed, and
    fields that every leaf sets to one value (and the top level does not set) moved up."""
    import copy

    doc = copy.deepcopy(document)
    leaves = [body for kind, body in node_bodies(doc.get("tree")) if kind == "leaf"]
    for key in TRANSFER_FIELDS:
        if key in doc or not leaves:
            continue
        values = [body.get(key, _MISSING) for body in leaves]
        if values[0] is not _MISSING and all(v == values[0] for v in values):
            doc[key] = values[0]
    ordered: dict[str, Any] = {}
    for key in ("version", *TRANSFER_FIELDS):
        if key in doc:
            ordered[key] = doc.pop(key)
    ordered.update(doc)
    for body in leaves:
        for key in TRANSFER_FIELDS:
            if key in body and key in ordered and body[key] == ordered[key]:
                del body[key]
    tree = ordered.pop("tree")
    ordered["tree"] = tree
    return ordered


_MISSING = object()
