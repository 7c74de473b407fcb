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
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, Tag, ValidationError

from kvcompose.tree.fields import describe

#: Characters of a value echoed in a message.
MAX_SHOWN = 60

Loc = tuple[str | int, ...]

#: A numeric bound's sign, by its name in a ``Field`` and in pydantic's error context.
BOUND_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
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


def format_path(path: Iterable[str | int]) -> str:
    """``("tree", "chain", "children", 1, "leaf")`` -> ``tree.chain.children[1].leaf``."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            text = str(part)
            if len(text) > MAX_SHOWN:
                text = text[:MAX_SHOWN] + "..."
            out += ("." if out else "") + text
    return out


def at(path: Iterable[str | int], message: str) -> str:
    """``path: message``; the message alone at the top level."""
    where = format_path(path)
    return f"{where}: {message}" if where else message


def closest(word: Any, choices: Iterable[str]) -> str | None:
    """The choice ``word`` was probably meant as (a close spelling, or another case)."""
    if not isinstance(word, str) or len(word) > 4 * MAX_SHOWN:
        return None
    choices = list(choices)
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if matches:
        return matches[0]
    return {c.lower(): c for c in choices}.get(word.lower())


def did_you_mean(word: Any, choices: Iterable[str], meant: str | None = None) -> str:
    """`` (did you mean 'x'?)`` (``meant``, else the closest choice) or an empty string."""
    meant = meant or closest(word, choices)
    return f" (did you mean {meant!r}?)" if meant else ""


def unknown(key: Any, allowed: Sequence[str], meant: str | None = None, what: str = "key") -> str:
    """``unknown key 'x'`` and the key it was probably meant as (``meant``, else the closest
    of ``allowed``), or else the keys ``allowed``."""
    hint = did_you_mean(key, allowed, meant)
    if not hint and allowed:
        hint = f" (allowed: {', '.join(allowed)})"
    return f"unknown {what} {shown(key)}{hint}"


def key_not_string(key: Any) -> str:
    """A mapping key that is not a string (for YAML's mapping or list keys: ``{}``, ``[]``)."""
    return f"keys must be strings, got {describe(key)}"


class Wording:
    """How a model's validation errors read. Subclasses may word some errors their own way
    (``error`` returning None leaves an error to the defaults). ``root`` is None for a
    pydantic class that is no ``BaseModel`` (vLLM's configs): its keys are then not listed."""

    def __init__(self, root: type[BaseModel] | None) -> None:
        self.root = root

    def problems(self, exc: ValidationError) -> list[tuple[Loc, str]]:
        """(path, message) for each error: unknown keys first (a typo is usually the cause
        of the rest), and no "missing 'x'" where an unknown key was probably meant as 'x'."""
        errors = exc.errors()
        meant = {
            (*err["loc"][:-1], self.meant(tuple(err["loc"])))
            for err in errors
            if err["type"] == "extra_forbidden" and err["loc"]
        }
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
        if kind == "kvcompose":  # tree.fields.custom_error: our own words, as they are
            return loc, err["msg"]
        if kind == "invalid_key":  # config and proxy data never get here (walk.check_plain)
            return loc[:-1], key_not_string(loc[-1])
        if kind == "extra_forbidden":
            return loc, self.unknown_key(loc)
        if kind == "missing":
            return loc[:-1], self.missing(loc)
        if kind == "literal_error":
            options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
            listed = ", ".join(repr(o) for o in options)
            hint = did_you_mean(value, options)
            return loc, f"must be one of {listed}, got {describe(value)}{hint}"
        bound = next((name for name in ctx if name in BOUND_SIGNS), None)
        if bound is not None:  # greater_than and its kin
            return loc, f"must be {BOUND_SIGNS[bound]} {ctx[bound]}, got {shown(value)}"
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

    def model_at(self, loc: Loc) -> type[BaseModel] | dict[str, type[BaseModel]] | None:
        """The model that validates the mapping at ``loc`` or, where a tagged union is (a
        node: one key, its kind), the model of each tag. List indexes are skipped."""
        shape: type[BaseModel] | dict[str, type[BaseModel]] | None = self.root
        for part in loc:
            if isinstance(part, int) and not isinstance(part, bool):
                continue
            if isinstance(shape, dict):
                shape = shape.get(str(part))
            elif shape is not None:
                field = shape.model_fields.get(str(part))
                shape = _model_in(field.annotation) if field is not None else None
        return shape

    def allowed(self, loc: Loc) -> list[str]:
        """The keys the mapping at ``loc`` may hold."""
        shape = self.model_at(loc)
        return list(shape.model_fields if isinstance(shape, type) else shape or ())

    def meant(self, loc: Loc) -> str | None:
        """The key an unknown key at ``loc`` was probably meant as."""
        return closest(loc[-1], self.allowed(loc[:-1]))

    def unknown_key(self, loc: Loc) -> str:
        return unknown(loc[-1], self.allowed(loc[:-1]), self.meant(loc))

    def missing(self, loc: Loc) -> str:
        """``missing required key 'x'``, with the first words of the field's description."""
        model = self.model_at(loc[:-1])
        field = model.model_fields.get(str(loc[-1])) if isinstance(model, type) else None
        text = f"missing required key {str(loc[-1])!r}"
        about = re.split(r"[.:] | \(|\.$", field.description or "")[0] if field else ""
        return f"{text} ({about[:1].lower()}{about[1:]})" if about else text


_WRAPPERS = (typing.Union, types.UnionType, list, tuple, typing.Annotated)


def _model_in(annotation: Any) -> type[BaseModel] | dict[str, type[BaseModel]] | None:
    """The model inside a field's type (``X | None``, ``list[X]``, ``Annotated[X, ...]``);
    for a union of ``Tag``-ged models, the model of each tag (pydantic puts the tag in
    an error's ``loc``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) not in _WRAPPERS:
        return None
    args = typing.get_args(annotation)
    tagged = {
        meta.tag: arg.__origin__
        for arg in args
        for meta in getattr(arg, "__metadata__", ())
        if isinstance(meta, Tag)
    }
    if tagged:
        return tagged
    for arg in args:
        model = _model_in(arg)
        if model is not None:
            return model
    return None
