"""Checking Python data that did not come from a file: is it plain JSON, and bounded?

A ``kv_connector_extra_config`` from vLLM, a dict handed to ``load_config``, an override
value: whatever reaches ``vllm-args`` must be JSON (vLLM passes the config on as JSON), and
nothing may make validation recurse without end or expand without bound. Shared objects
count once per reference, as YAML aliases do, against ``MAX_ALIAS_NODES``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from kvcompose.config.errors import ConfigError, ErrorItem, Path, describe
from kvcompose.config.limits import MAX_ALIAS_NODES, MAX_DEPTH, MAX_INT_DIGITS

_SCALARS = (str, bool, type(None))
#: Integers with more digits than this are refused (checked by magnitude, not by str()).
_INT_BOUND = 10**MAX_INT_DIGITS


def check_plain(data: Any, label: str | None, prefix: Path = ()) -> None:
    """Raise ``ConfigError`` unless ``data`` is plain JSON data of bounded size and depth."""
    sizes: dict[int, int] = {}
    active: set[int] = set()
    aliased = 0
    # frames: [object, path, depth, iterator of (path, child), size]
    stack: list[list[Any]] = []

    def fail(path: Path, message: str) -> ConfigError:
        return ConfigError(ErrorItem(path, message), label)

    def enter(value: Any, path: Path, depth: int) -> int | None:
        nonlocal aliased
        if isinstance(value, _SCALARS):
            return 1
        if isinstance(value, int):
            if abs(value) >= _INT_BOUND:
                raise fail(path, f"integer is too large (more than {MAX_INT_DIGITS} digits)")
            return 1
        if isinstance(value, float):
            if not math.isfinite(value):
                raise fail(
                    path, f"{value} is not a JSON value (NaN and infinities have no JSON form)"
                )
            return 1
        if isinstance(value, BaseModel):  # a node object handed over as is
            return 1
        if not isinstance(value, (Mapping, list, tuple)):
            raise fail(
                path,
                f"{describe(value)} is not a JSON value (expected mappings, "
                "lists, strings, numbers, booleans or null)",
            )
        key = id(value)
        if key in active:
            raise fail(
                path,
                "refers to a mapping or list that contains it (a recursive "
                "structure cannot be written as JSON)",
            )
        if key in sizes:
            aliased += sizes[key]
            if aliased > MAX_ALIAS_NODES:
                raise fail(
                    path,
                    f"shared objects expand this config by more than {MAX_ALIAS_NODES:,} nodes",
                )
            return sizes[key]
        if depth > MAX_DEPTH:
            raise fail(path[: MAX_DEPTH // 4], f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, Mapping):
            for k in value:
                if not isinstance(k, str):
                    raise fail(path, f"keys must be strings, got {describe(k)}")
            children: Any = (((*path, k), v) for k, v in value.items())
        else:
            children = (((*path, i), v) for i, v in enumerate(value))
        active.add(key)
        stack.append([value, path, depth, iter(children), 1])
        return None

    if enter(data, prefix, 0) is not None:
        return
    while stack:
        frame = stack[-1]
        step = next(frame[3], None)
        if step is None:
            stack.pop()
            active.discard(id(frame[0]))
            sizes[id(frame[0])] = frame[4]
            if stack:
                stack[-1][4] += frame[4]
            continue
        size = enter(step[1], step[0], frame[2] + 1)
        if size is not None:
            frame[4] += size
