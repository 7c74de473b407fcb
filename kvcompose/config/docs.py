"""Generates ``docs/config.md`` from the schema (``kvcompose schema --markdown``), and the
settings table of any model (``settings_table``).

The field tables come from the pydantic models; the prose around them lives in
``reference.md.tmpl`` beside this module, so that the whole reference is one generated file,
kept in sync by a test.
"""

from __future__ import annotations

import string
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from kvcompose.config import deadline
from kvcompose.config.env import ENV_CONFIG_FILE, ENV_SET
from kvcompose.config.limits import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_INCLUDE_DEPTH,
    MAX_INT_DIGITS,
    PIPE_WAIT_S,
    size_text,
)
from kvcompose.tree import NAME_PATTERN, VERSION, Chain, Document, Fanout, Leaf, Route, RouteRule
from kvcompose.tree.error_messages import BOUND_SIGNS

#: The prose of docs/config.md, with ``$name`` placeholders for the generated parts.
_TEMPLATE = Path(__file__).with_name("reference.md.tmpl")


def render_markdown() -> str:
    return string.Template(_TEMPLATE.read_text(encoding="utf-8")).substitute(
        version=VERSION,
        document=settings_table(Document),
        leaf=settings_table(Leaf),
        chain=settings_table(Chain),
        fanout=settings_table(Fanout),
        route=settings_table(Route),
        rule=settings_table(RouteRule),
        pattern=NAME_PATTERN,
        env_set=ENV_SET,
        env_file=ENV_CONFIG_FILE,
        max_bytes=size_text(MAX_FILE_BYTES),
        max_depth=MAX_DEPTH,
        max_alias=f"{MAX_ALIAS_NODES:,}",
        max_digits=MAX_INT_DIGITS,
        max_include=MAX_INCLUDE_DEPTH,
        pipe_s=f"{PIPE_WAIT_S:g}",
        check_s=f"{deadline.DEFAULT_S:g}",
        check_env=deadline.ENV,
        grace_s=f"{deadline.GRACE_S:g}",
    )


#: Fields whose type is a tree node, or a list of nodes or rules.
_NODE_TYPES = {
    "tree": "node",
    "children": "list of nodes",
    "rules": "list of rules",
    "hma": "`true` \\| `false` \\| `auto`",
}


def settings_table(model: type[BaseModel]) -> str:
    """The model's fields in their own order (the order dumps use too): this reference's
    tables, and the store settings' in ``docs/stores.md`` (``kvcompose schema --stores``)."""
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        required = info.is_required()
        default = "required" if required else _default(info)
        kind = (_NODE_TYPES.get(name) or _type(info.annotation)) + _bounds(info.metadata)
        description = (info.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{name}` | {kind} | {default} | {description} |")
    return "\n".join(rows)


def _bounds(metadata: list[Any]) -> str:
    """`` >= 1`` for ``Field(ge=1)`` (annotated-types constraints, as pydantic keeps them)."""
    bounds = [
        f"{sign} {getattr(m, attr)}"
        for m in metadata
        for attr, sign in BOUND_SIGNS.items()
        if getattr(m, attr, None) is not None
    ]
    return " " + ", ".join(bounds) if bounds else ""


def _default(info: Any) -> str:
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is None:
        return "unset"
    if value == {} or value == []:
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " \\| ".join(parts)
    if origin is list:
        return f"list of {_type(args[0] if args else Any)}s"
    if origin is dict:
        return "mapping"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))
