"""Command-line flags generated from the bench's option dataclasses.

A field declared with ``opt(...)`` becomes a flag: ``--`` + prefix + the field name with
dashes (or the ``flags`` given), its type and default from the field, ``bool`` fields as
``--x/--no-x``, ``list[int]`` fields as comma-separated integers. ``build`` reads the parsed
values back into the dataclass, so a new option is one field, not three edits.

Numbers are checked as they are parsed, so a bad one is a usage error before any engine
starts: every number is at least ``minimum`` (default 0; no count, length or time here is
negative) and every float is finite (a NaN arrival gap would never arrive).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    flags: tuple[str, ...] = (),
    group: str | None = None,
    metavar: str | None = None,
    cli: bool = True,
    minimum: float = 0,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with its command-line flag (``cli=False``: no flag)."""
    meta = {
        "help": help,
        "flags": flags,
        "group": group,
        "metavar": metavar,
        "cli": cli,
        "minimum": minimum,
        "choices": choices,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _kind(tp: Any) -> tuple[type, bool]:
    """``(base type, optional)`` of a field annotation (``int | None`` -> ``(int, True)``)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _kind(args[0])[0], True
    origin = typing.get_origin(tp)
    if origin is list:
        return list, False
    return tp, False


def number(base: type, minimum: float = 0) -> Callable[[str], Any]:
    """An argparse ``type``: ``base`` (int or float), finite, at least ``minimum``."""

    def parse(text: str) -> Any:
        try:
            value = base(text)
        except ValueError:
            kind = "an integer" if base is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {text!r}")
        return value

    return parse


def int_list(minimum: float = 0) -> Callable[[str], list[int]]:
    """An argparse ``type``: at least one comma-separated integer, each at least ``minimum``."""
    one = number(int, minimum)

    def parse(text: str) -> list[int]:
        parts = [s for s in str(text).split(",") if s.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        try:
            return [one(s) for s in parts]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers of at least {minimum:g}, got {text!r}"
            ) from exc

    return parse


def cli_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    prefix: str = "",
    groups: dict[str, Any] | None = None,
) -> None:
    """Add a flag for every ``opt`` field of ``cls`` (to ``groups[field's group]`` if given)."""
    hints = typing.get_type_hints(cls)
    for f in cli_fields(cls):
        target = (groups or {}).get(f.metadata["group"], parser)
        names = f.metadata["flags"] or (f"--{prefix}{f.name.replace('_', '-')}",)
        base, _ = _kind(hints[f.name])
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        kw: dict[str, Any] = {
            "dest": dest(cls, f.name),
            "default": default,
            "help": f.metadata["help"] or None,
            "metavar": f.metadata["metavar"] or f.name.upper(),
        }
        if base is bool:
            del kw["metavar"]
            kw["action"] = argparse.BooleanOptionalAction
        elif base is list:
            kw["type"] = int_list(f.metadata["minimum"])
            kw["default"] = ",".join(str(x) for x in default)  # argparse parses it
        elif base in (int, float):
            kw["type"] = number(base, f.metadata["minimum"])
        else:
            kw["type"] = base
            kw["choices"] = f.metadata["choices"]
        target.add_argument(*names, **kw)


def dest(cls: type, name: str) -> str:
    return f"{cls.__name__}.{name}"


def build(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """An instance of ``cls`` from the parsed flags (``given`` fills the other fields)."""
    values = {f.name: getattr(args, dest(cls, f.name)) for f in cli_fields(cls)}
    return cls(**{**values, **given})
