"""The one walk over a config's data: is it plain JSON, bounded, and where is each path?

Whatever reaches ``vllm-args`` must be JSON (vLLM passes the config on as JSON), and nothing
may make validation recurse without end or expand without bound. The same walk checks data
read from YAML or JSON text (``parse``: its ``NotJson`` markers and repeated keys are
reported here, at their path and line) and data handed over in Python (a
``kv_connector_extra_config``, a dict given to ``load_config``, an override value).

Shared objects (YAML aliases, or one Python object referred to twice) are visited once and
count once per reference against ``MAX_ALIAS_NODES``, so an alias bomb costs what its text
costs; an object that contains itself is refused. The walk is iterative: nesting never
meets Python's recursion limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from kvcompose.config.errors import ConfigError, ErrorItem, LineMap, Path
from kvcompose.config.limits import MAX_ALIAS_NODES, MAX_DEPTH, MAX_INT_DIGITS
from kvcompose.config.parse import NOT_FINITE, TOO_DEEP, TOO_MANY_DIGITS, Marks, NotJson
from kvcompose.tree import describe
from kvcompose.tree.error_messages import key_not_string, shown

_SCALARS = (str, bool, type(None))
#: Integers with more digits than this are refused (checked by magnitude, not by str()).
_INT_BOUND = 10**MAX_INT_DIGITS
#: Problems reported at most (the first is the message; the count says how many more).
_MAX_PROBLEMS = 50


class _Stop(Exception):
    """A problem that ends the walk (the data cannot be walked further)."""


def check_plain(data: Any, label: str | None, marks: Marks | None = None) -> LineMap:
    """The line of each path (from ``marks``, when the data was read from text); raises
    ``ConfigError`` unless ``data`` is plain JSON data of bounded size and depth."""
    marks = marks or Marks()
    linemap = LineMap({(): marks.root} if marks.root else {})
    problems: list[ErrorItem] = []
    sizes: dict[int, int] = {}  # id(container) -> nodes it stands for, shared ones expanded
    active: set[int] = set()  # containers on the current path
    aliased = 0  # nodes that shared objects add
    # frames: [container, path, depth, iterator of (key, child), size]
    stack: list[list[Any]] = []

    def problem(path: Path, message: str, line: int | None = None, *, stop: bool = False) -> None:
        item = ErrorItem(path, message, line or linemap.get(path))
        if stop:
            problems[:] = [item]
            raise _Stop
        if len(problems) < _MAX_PROBLEMS:
            problems.append(item)

    def enter(value: Any, path: Path, depth: int) -> int | None:
        """The size of a scalar or an already seen container; None when a frame was pushed."""
        nonlocal aliased
        if isinstance(value, (*_SCALARS, BaseModel)):  # BaseModel: a node handed over as is
            return 1
        if isinstance(value, NotJson):
            problem(path, value.message)
            return 1
        if isinstance(value, int):
            if abs(value) >= _INT_BOUND:
                problem(path, TOO_MANY_DIGITS)
            return 1
        if isinstance(value, float):
            if not math.isfinite(value):
                problem(path, f"{value} {NOT_FINITE}")
            return 1
        if not isinstance(value, (Mapping, list, tuple)):
            problem(
                path,
                f"{describe(value)} is not a JSON value (expected mappings, "
                "lists, strings, numbers, booleans or null)",
            )
            return 1
        key = id(value)
        if key in active:
            problem(
                path,
                "refers to a mapping or list that contains it (a recursive structure cannot be "
                "written as JSON)",
                stop=True,
            )
        if key in sizes:
            aliased += sizes[key]
            if aliased > MAX_ALIAS_NODES:
                problem(
                    path,
                    f"aliases or shared objects expand this config by more than "
                    f"{MAX_ALIAS_NODES:,} nodes (an alias bomb?)",
                    stop=True,
                )
            return sizes[key]
        if depth > MAX_DEPTH:
            problem(path[: MAX_DEPTH // 4], TOO_DEEP, stop=True)
        lines = marks.lines.get(key, {})
        for child, line in lines.items():
            linemap[(*path, child)] = line
        for child, text in marks.hints.get(key, {}).items():
            linemap.hints[(*path, child)] = text
        for name, line, first in marks.duplicates.get(key, ()):
            problem((*path, name), f"duplicate key {shown(name)} (first set on line {first})", line)
        children: Any = value.items() if isinstance(value, Mapping) else enumerate(value)
        active.add(key)
        stack.append([value, path, depth, iter(children), 1])
        return None

    try:
        if enter(data, (), 0) is None:
            while stack:
                frame = stack[-1]
                step = next(frame[3], None)
                if step is None:  # the container is done
                    stack.pop()
                    active.discard(id(frame[0]))
                    sizes[id(frame[0])] = frame[4]
                    if stack:
                        stack[-1][4] += frame[4]
                    continue
                key, child = step
                if type(child) is str and type(key) is str:  # most of a config, at once
                    frame[4] += 1
                    continue
                if not isinstance(key, str) and isinstance(frame[0], Mapping):
                    # reported at the mapping, on the key's line; its value is not walked
                    message = key.message if isinstance(key, NotJson) else key_not_string(key)
                    problem(frame[1], message, linemap.get((*frame[1], key)))
                    frame[4] += 1
                    continue
                size = enter(child, (*frame[1], key), frame[2] + 1)
                if size is not None:
                    frame[4] += size
    except _Stop:
        pass
    if problems:
        raise ConfigError(problems, label)
    return linemap
