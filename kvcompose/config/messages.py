"""pydantic's errors about a document, in kvcompose's words (``tree.messages.Wording``) with
what only a document has: nodes written as one kind key, and vLLM's spellings of our keys."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvcompose.config.errors import ErrorItem
from kvcompose.tree import NODE_KIND_ERROR, NODE_KINDS, TRANSFER_FIELDS, Document
from kvcompose.tree.error_messages import Loc, Wording, shown

#: vLLM's spelling of a leaf's own keys -> ours (MultiConnector JSON is read with it too).
LEAF_KEYS = {
    "kv_connector": "connector",
    "kv_connector_module_path": "module_path",
    "kv_connector_extra_config": "extra_config",
}
#: vLLM's spelling -> ours, for "did you mean".
_ALIASES = {**LEAF_KEYS, "connectors": "children"}
#: Listed last among a mapping's keys: inherited, rarely set.
_LATE = frozenset((*TRANSFER_FIELDS, "transfer_config"))


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
        if err["type"] == "string_pattern_mismatch" and loc and loc[-1] == "name":
            return [
                (
                    loc,
                    f"invalid node name {shown(err.get('input'))}: use letters, digits, '_' "
                    "and '-' (at most 64 characters, no dots)",
                )
            ]
        return None

    def allowed(self, loc: Loc) -> list[str]:
        return sorted(super().allowed(loc), key=lambda key: key in _LATE)

    def meant(self, loc: Loc) -> str | None:
        alias = _ALIASES.get(loc[-1]) if isinstance(loc[-1], str) else None
        return alias if alias in self.allowed(loc[:-1]) else super().meant(loc)

    def unknown_key(self, loc: Loc) -> str:
        key = loc[-1]
        if key in ("type", "kind"):
            return f"unknown key {shown(key)}: use a kind key (leaf, chain, fanout, route)"
        node = self.model_at(loc[:-1])
        if isinstance(node, dict):  # a node's own mapping: its one key is the kind
            kind = next((kind for kind, body in node.items() if key in body.model_fields), None)
            if kind is not None:
                return (
                    f"unknown key {shown(key)}: node settings go inside the kind, "
                    f"e.g. '{kind}: {{{key}: ...}}'"
                )
        return super().unknown_key(loc)


_WORDING = _DocumentWording(Document)


def items_from_validation(exc: ValidationError) -> list[ErrorItem]:
    """Our messages for pydantic's errors about a document (see ``tree.messages``)."""
    return [ErrorItem(loc, message) for loc, message in _WORDING.problems(exc)]
