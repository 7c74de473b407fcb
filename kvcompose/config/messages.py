"""Turning pydantic's validation errors into short messages with "did you mean"."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from kvcompose.config.errors import ErrorItem, Path, describe, did_you_mean, shown
from kvcompose.tree import (
    NODE_KIND_ERROR,
    NODE_KINDS,
    TRANSFER_FIELDS,
    Chain,
    Document,
    Fanout,
    Leaf,
    Route,
    RouteRule,
)


class _NodeKey(BaseModel):
    """Stands for a node's own mapping (one key, the kind) in ``model_at``."""


_BODY: dict[str, type[BaseModel]] = {"leaf": Leaf, "chain": Chain, "fanout": Fanout, "route": Route}
_NEXT: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (Document, "tree"): _NodeKey,
    **{(_NodeKey, kind): model for kind, model in _BODY.items()},
    **{(model, "children"): _NodeKey for model in (Chain, Fanout, Route)},
    (Route, "rules"): RouteRule,
}

#: vLLM's spelling -> ours, for "did you mean".
_ALIASES = {
    "kv_connector": "connector",
    "kv_connector_module_path": "module_path",
    "kv_connector_extra_config": "extra_config",
    "connectors": "children",
    "type": "a kind key (leaf, chain, fanout, route)",
    "kind": "a kind key (leaf, chain, fanout, route)",
}

_MISSING = {
    "connector": "missing required key 'connector' (the vLLM connector name)",
    "default": "missing required key 'default': a route needs a default child, used when "
    "no rule matches",
    "children": "missing required key 'children'",
    "tree": "missing required key 'tree' (the root node)",
    "child": "missing required key 'child' (the child this rule sends requests to)",
}

_TYPES = {
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
    "tuple_type": "expected a list",
}


def model_at(loc: Path) -> type[BaseModel] | None:
    """The schema model that validates the mapping found at ``loc`` in a document."""
    model: type[BaseModel] | None = Document
    pending_list = False
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int) and not isinstance(part, bool):
            if not pending_list:
                return None
            pending_list = False
            continue
        nxt = _NEXT.get((model, str(part)))
        if nxt is None:
            return None
        pending_list = str(part) in ("children", "rules")
        model = nxt
    return None if pending_list else model


def items_from_validation(exc: ValidationError) -> list[ErrorItem]:
    """Our messages for pydantic's errors: unknown keys first (a typo is usually the cause of
    the rest), and no "missing 'x'" where an unknown key was probably meant to be 'x'."""
    items: list[ErrorItem] = []
    seen: set[tuple[Path, str]] = set()
    typos: set[tuple[Path, str]] = set()
    errors = exc.errors()
    for err in errors:
        if err["type"] == "extra_forbidden" and err["loc"]:
            loc = tuple(err["loc"])
            match = re.search(r"did you mean '([^']+)'", _unknown_key(loc))
            if match:
                typos.add((loc[:-1], match.group(1)))
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] == "missing" and loc and (loc[:-1], str(loc[-1])) in typos:
            continue
        for item in _items(err):
            key = (item.path, item.message)
            if key not in seen:
                seen.add(key)
                items.append(item)
    items.sort(key=lambda i: not i.message.startswith("unknown key"))
    return items


def _items(err: dict[str, Any]) -> list[ErrorItem]:
    """A mapping that is no node yields one item per key that names no kind."""
    if err["type"] == NODE_KIND_ERROR and isinstance(err.get("input"), dict):
        loc = tuple(err["loc"])
        return [
            ErrorItem((*loc, key), _unknown_key((*loc, key)))
            for key in err["input"]
            if key not in NODE_KINDS
        ]
    return [_item(err)]


def _item(err: dict[str, Any]) -> ErrorItem:
    loc: Path = tuple(err["loc"])
    kind = err["type"]
    value = err.get("input")
    ctx = err.get("ctx") or {}
    if loc and loc[-1] == "[key]":  # a mapping key of the wrong type
        return ErrorItem(loc[:-2], f"keys must be strings, got {describe(loc[-2])}")
    if kind == "extra_forbidden":
        return ErrorItem(loc, _unknown_key(loc))
    if kind == "missing":
        key = str(loc[-1]) if loc else ""
        parent = loc[:-1]
        if key == "default" and model_at(parent) is Route:
            return ErrorItem(parent, _MISSING["default"])
        return ErrorItem(parent, _MISSING.get(key, f"missing required key {key!r}"))
    if kind == "kvcompose":
        return ErrorItem(loc, err["msg"])
    if kind in _TYPES:
        return ErrorItem(loc, f"{_TYPES[kind]}, got {describe(value)}")
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        listed = ", ".join(repr(o) for o in options)
        hint = did_you_mean(value, options)
        return ErrorItem(loc, f"must be one of {listed}, got {describe(value)}{hint}")
    if kind == "string_pattern_mismatch" and loc and loc[-1] == "name":
        return ErrorItem(
            loc,
            f"invalid node name {shown(value)}: use letters, digits, '_' and "
            "'-' (at most 64 characters, no dots)",
        )
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        sign = {
            "greater_than": ">",
            "greater_than_equal": ">=",
            "less_than": "<",
            "less_than_equal": "<=",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        return ErrorItem(loc, f"must be {sign} {bound}, got {shown(value)}")
    if kind == "string_too_short":
        return ErrorItem(loc, "must not be empty")
    if kind == "string_too_long":
        return ErrorItem(
            loc, f"too long ({len(value)} characters; at most {ctx.get('max_length', '?')})"
        )
    if kind == "invalid_key":
        return ErrorItem(loc[:-1], f"keys must be strings, got {describe(loc[-1])}")
    message = str(err.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    return ErrorItem(loc, message[:1].lower() + message[1:])


def _unknown_key(loc: Path) -> str:
    key = loc[-1] if loc else ""
    parent = loc[:-1]
    model = model_at(parent)
    allowed = list(model.model_fields) if model and model is not _NodeKey else []
    late = (*TRANSFER_FIELDS, "transfer_config")
    allowed = [k for k in allowed if k not in late] + [k for k in allowed if k in late]
    text = f"unknown key {shown(key)}"
    if model is _NodeKey and isinstance(key, str):
        for kind in NODE_KINDS:
            if key in _BODY[kind].model_fields:
                return f"{text}: node settings go inside the kind, e.g. 'leaf: {{{key}: ...}}'"
        hint = did_you_mean(key, NODE_KINDS)
        return f"{text}{hint or ' (a node is one of leaf, chain, fanout, route)'}"
    alias = _ALIASES.get(key) if isinstance(key, str) else None
    if alias and (alias in allowed or alias.startswith("a kind")):
        return f"{text} (did you mean {alias!r}?)" if alias in allowed else f"{text}: use {alias}"
    hint = did_you_mean(key, allowed)
    if not hint and allowed:
        return f"{text} (allowed: {', '.join(allowed)})"
    return text + hint
