"""pydantic's errors about a document, in kvcompose's words (``tree.messages.Wording``) with
what only a document has: nodes written as one kind key, vLLM's spellings of our keys, and
the required keys whose absence needs a word on what they are for."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from kvcompose.config.errors import ErrorItem, Path, shown
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
from kvcompose.tree.messages import Loc, Wording, did_you_mean


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


class _DocumentWording(Wording):
    def error(self, err: Any) -> list[tuple[Loc, str]] | None:
        loc: Loc = tuple(err["loc"])
        if err["type"] == NODE_KIND_ERROR and isinstance(err.get("input"), dict):
            # a mapping that is no node: one problem per key that names no kind
            return [
                ((*loc, key), self.unknown_key((*loc, key)))
                for key in err["input"]
                if key not in NODE_KINDS
            ]
        if err["type"] == "kvcompose":  # our own validators' words, as they are
            return [(loc, err["msg"])]
        if err["type"] == "string_pattern_mismatch" and loc and loc[-1] == "name":
            return [
                (
                    loc,
                    f"invalid node name {shown(err.get('input'))}: use letters, digits, '_' "
                    "and '-' (at most 64 characters, no dots)",
                )
            ]
        return None

    def model_at(self, loc: Loc) -> type[BaseModel] | None:
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

    def missing(self, loc: Loc) -> str:
        key = str(loc[-1])
        return _MISSING.get(key, f"missing required key {key!r}")

    def unknown_key(self, loc: Loc) -> str:
        key = loc[-1] if loc else ""
        model = self.model_at(loc[:-1])
        text = f"unknown key {shown(key)}"
        if model is _NodeKey and isinstance(key, str):
            for kind in NODE_KINDS:
                if key in _BODY[kind].model_fields:
                    return f"{text}: node settings go inside the kind, e.g. 'leaf: {{{key}: ...}}'"
            hint = did_you_mean(key, NODE_KINDS)
            return f"{text}{hint or ' (a node is one of leaf, chain, fanout, route)'}"
        allowed = list(model.model_fields) if model is not None else []
        late = (*TRANSFER_FIELDS, "transfer_config")  # listed last: inherited, rarely set
        allowed = [k for k in allowed if k not in late] + [k for k in allowed if k in late]
        alias = _ALIASES.get(key) if isinstance(key, str) else None
        if alias and (alias in allowed or alias.startswith("a kind")):
            if alias in allowed:
                return f"{text} (did you mean {alias!r}?)"
            return f"{text}: use {alias}"
        hint = did_you_mean(key, allowed)
        if not hint and allowed:
            return f"{text} (allowed: {', '.join(allowed)})"
        return text + hint


_WORDING = _DocumentWording(Document)


def model_at(loc: Path) -> type[BaseModel] | None:
    """The schema model that validates the mapping found at ``loc`` in a document."""
    return _WORDING.model_at(loc)


def items_from_validation(exc: ValidationError) -> list[ErrorItem]:
    """Our messages for pydantic's errors about a document (see ``tree.messages``)."""
    return [ErrorItem(loc, message) for loc, message in _WORDING.problems(exc)]
