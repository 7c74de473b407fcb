"""pydantic's validation errors as kvcompose messages: one short line per problem, naming the
key, what it must be and what it got, with "did you mean" for an unknown key.

Used by every layer that validates user input with pydantic: the config (its document
models, with node-specific wording on top: ``config.messages``), the proxy's settings and
the stores' ``kv_connector_extra_config``. What a setting must be is stated once, in its
``Field`` (type, constraints, description); the wording here derives from pydantic's error,
so a new field or constraint needs no new sentence anywhere.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from kvcompose.tree.fields import describe

#: Characters of a value echoed in a message.
MAX_SHOWN = 60

Loc = tuple[str | int, ...]

_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
#: pydantic's words for JSON's values, in the words of a YAML or JSON config.
_WORDS = {"dictionary": "mapping", "tuple": "list"}
_EXPECTED = re.compile(r"Input should be (?:a valid |an? )?([^,]*)")


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, shortened: messages never echo a huge value whole."""
    if isinstance(value, str) and len(value) > limit:
        text = repr(value[:limit])
        return f"{text[:-1]}...{text[-1]}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` or an empty string."""
    if not isinstance(word, str) or len(word) > 4 * MAX_SHOWN:
        return ""
    choices = list(choices)
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not matches:
        lowered = {c.lower(): c for c in choices}
        if word.lower() in lowered:
            matches = [lowered[word.lower()]]
    return f" (did you mean {matches[0]!r}?)" if matches else ""


class Wording:
    """How a model's validation errors read. Subclasses may word some errors their own way
    (``error`` returning None leaves an error to the defaults)."""

    def __init__(self, root: type[BaseModel]) -> None:
        self.root = root

    def problems(self, exc: ValidationError) -> list[tuple[Loc, str]]:
        """(path, message) for each error: unknown keys first (a typo is usually the cause
        of the rest), and no "missing 'x'" where an unknown key was probably meant as 'x'."""
        errors = exc.errors()
        meant = set()
        for err in errors:
            if err["type"] == "extra_forbidden" and err["loc"]:
                loc = tuple(err["loc"])
                match = re.search(r"did you mean '([^']+)'", self.unknown_key(loc))
                if match:
                    meant.add((*loc[:-1], match.group(1)))
        out: list[tuple[Loc, str]] = []
        for err in errors:
            if err["type"] == "missing" and tuple(err["loc"]) in meant:
                continue
            for problem in self.error(err) or [self.default(err)]:
                if problem not in out:
                    out.append(problem)
        out.sort(key=lambda problem: not problem[1].startswith("unknown key"))
        return out

    def error(self, err: Any) -> list[tuple[Loc, str]] | None:
        """A subclass's own wording for ``err``; None for the default."""
        return None

    def default(self, err: Any) -> tuple[Loc, str]:
        loc: Loc = tuple(err["loc"])
        kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
        if loc and loc[-1] == "[key]":  # a mapping key of the wrong type
            return loc[:-2], f"keys must be strings, got {describe(loc[-2])}"
        if kind == "invalid_key":
            return loc[:-1], f"keys must be strings, got {describe(loc[-1])}"
        if kind == "extra_forbidden":
            return loc, self.unknown_key(loc)
        if kind == "missing":
            return loc[:-1], self.missing(loc)
        if kind == "literal_error":
            options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
            listed = ", ".join(repr(o) for o in options)
            hint = did_you_mean(value, options)
            return loc, f"must be one of {listed}, got {describe(value)}{hint}"
        if kind in _BOUNDS:
            bound = next(iter(ctx.values()), "?")
            return loc, f"must be {_BOUNDS[kind]} {bound}, got {shown(value)}"
        if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
            return loc, "must not be empty"
        if kind == "string_too_long":
            return loc, f"too long ({len(value)} characters; at most {ctx.get('max_length', '?')})"
        match = _EXPECTED.match(str(err.get("msg", "")))
        if match and (kind.endswith(("_type", "_parsing")) or kind == "int_from_float"):
            noun = match.group(1).split(" or ")[0]
            noun = _WORDS.get(noun, noun)
            article = "an" if noun[:1] in "aeiou" else "a"
            return loc, f"expected {article} {noun}, got {describe(value)}"
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        return loc, message[:1].lower() + message[1:]

    def model_at(self, loc: Loc) -> type[BaseModel] | None:
        """The model that validates the mapping at ``loc`` (list indexes are skipped)."""
        model: type[BaseModel] | None = self.root
        for part in loc:
            if model is None:
                return None
            if isinstance(part, int) and not isinstance(part, bool):
                continue
            field = model.model_fields.get(str(part))
            model = _model_in(field.annotation) if field is not None else None
        return model

    def unknown_key(self, loc: Loc) -> str:
        model = self.model_at(loc[:-1])
        allowed = list(model.model_fields) if model is not None else []
        text = f"unknown key {shown(loc[-1])}"
        hint = did_you_mean(loc[-1], allowed)
        if not hint and allowed:
            return f"{text} (allowed: {', '.join(allowed)})"
        return text + hint

    def missing(self, loc: Loc) -> str:
        """``missing required key 'x'``, with the first words of the field's description."""
        model = self.model_at(loc[:-1])
        field = model.model_fields.get(str(loc[-1])) if model is not None else None
        text = f"missing required key {str(loc[-1])!r}"
        about = re.split(r"[.:] |\.$", field.description or "")[0] if field is not None else ""
        return f"{text} ({about[:1].lower()}{about[1:]})" if about else text


_WRAPPERS = (typing.Union, types.UnionType, list, tuple, typing.Annotated)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside a field's type (``X | None``, ``list[X]``, ``Annotated[X, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in _WRAPPERS:
        for arg in typing.get_args(annotation):
            model = _model_in(arg)
            if model is not None:
                return model
    return None
