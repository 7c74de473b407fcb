"""One pass over a composed YAML node graph that builds the data, the line of every path,
and refuses what would go wrong later: duplicate
keys, keys that are not strings, values that are not JSON (dates, ``!!binary``, ``.nan``,
sets), integers too long to convert, nesting beyond ``MAX_DEPTH``, aliases that refer to
themselves or expand beyond ``MAX_ALIAS_NODES``. The walk visits each node once (memo on
node identity) and never follows an alias into a node it has already seen (the value built
for it is shared, as PyYAML's constructor shares it), so an alias bomb costs what its text
costs. It is iterative: nesting never meets Python's recursion limit.

JSON text goes through here too (JSON is nearly YAML), for its lines and the checks JSON
needs: duplicate keys, ``NaN``/``Infinity``, huge numbers.
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml

from kvcompose.config.errors import ConfigError, ErrorItem, LineMap, Path, describe, shown
from kvcompose.config.limits import MAX_ALIAS_NODES, MAX_DEPTH, MAX_INT_DIGITS

_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = {f"{_TAG}{t}" for t in ("str", "int", "float", "bool", "null")}
_MERGE = f"{_TAG}merge"
#: Spellings YAML 1.1 reads as booleans or numbers that JSON and YAML 1.2 read otherwise.
_JSON_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_JSON_FLOAT = re.compile(r"[-+]?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][-+]?[0-9]+)?")
_JSON_BOOL = frozenset({"true", "false", "True", "False", "TRUE", "FALSE"})
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NOT_JSON = {
    "timestamp": "a date",
    "binary": "!!binary data",
    "set": "a !!set",
    "omap": "an !!omap",
    "pairs": "a !!pairs list",
}
#: Problems reported at most (the first is the message; the count says how many more).
_MAX_PROBLEMS = 50


class _Stop(Exception):
    """Raised to end the walk at the first fatal problem."""

    def __init__(self, item: ErrorItem):
        self.item = item


def scan(root: yaml.Node, label: str | None, *, json_text: bool = False) -> LineMap:
    """The line map of composed JSON text; raises ``ConfigError`` for what it refuses."""
    walk = _Walk(json_text, build=False)
    walk.finish(walk.run(root), label)
    return walk.linemap


def build(root: yaml.Node, label: str | None) -> tuple[Any, LineMap]:
    """The data of a composed YAML document and its line map; raises ``ConfigError``."""
    walk = _Walk(False, build=True)
    data = walk.run(root)
    walk.finish(data, label)
    return data, walk.linemap


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


_BOOLS = yaml.constructor.SafeConstructor.bool_values


class _MergeKey(str):
    """``<<``, YAML's merge key (a quoted ``"<<"`` is a plain string key)."""


class _BadKey(str):
    """A key that is not a string (reported): its value is checked, not stored."""


class _Walk:
    def __init__(self, json_text: bool, build: bool):
        self.json_text = json_text
        self.build = build
        self.linemap = LineMap()
        self.problems: list[ErrorItem] = []
        self.sizes: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self.values: dict[int, Any] = {}  # id(node) -> the value built for it
        self.active: set[int] = set()  # nodes on the current path
        self.aliased = 0  # nodes that aliases add
        self.constructor = yaml.constructor.SafeConstructor()

    def problem(self, path: Path, message: str, line: int | None) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(ErrorItem(path, message, line))

    def finish(self, data: Any, label: str | None) -> None:
        if self.problems:
            raise ConfigError(self.problems, label)

    def run(self, root: yaml.Node) -> Any:
        try:
            return self._run(root)
        except _Stop as stop:
            self.problems = [stop.item]
            return None

    def _run(self, root: yaml.Node) -> Any:
        # frames: [node, path, depth, iterator of (key, child node, key line), size,
        #          container, merges]
        self.linemap.setdefault((), _line(root))
        stack: list[list[Any]] = []
        done = self.enter(root, (), 0, stack)
        if done is not None:  # a lone scalar
            return done[1]
        while True:
            frame = stack[-1]
            step = next(frame[3], None)
            if step is None:
                stack.pop()
                node = frame[0]
                value = self.close(frame)
                self.active.discard(id(node))
                self.sizes[id(node)] = frame[4]
                self.values[id(node)] = value
                if not stack:
                    return value
                self.put(stack[-1], frame[1][-1], frame[4], value)
                continue
            key, child, line = step
            path = (*frame[1], key)
            self.linemap.setdefault(path, line if line is not None else _line(child))
            done = self.enter(child, path, frame[2] + 1, stack)
            if done is not None:
                self.put(frame, key, *done)

    def put(self, frame: list[Any], key: Any, size: int, value: Any) -> None:
        frame[4] += size
        if not self.build or isinstance(key, _BadKey):
            return
        container = frame[5]
        if isinstance(container, list):
            container.append(value)
        elif isinstance(key, _MergeKey):
            frame[6].append(value)
        else:
            container[key] = value

    def close(self, frame: list[Any]) -> Any:
        """The built value of a finished mapping or list (merge keys applied)."""
        container, merges = frame[5], frame[6]
        if not merges:
            return container
        merged: dict[str, Any] = {}
        for value in merges:
            sources = [value] if isinstance(value, dict) else list(reversed(value))
            for source in sources:
                if not isinstance(source, dict):
                    self.problem(
                        frame[1],
                        "a merge key (<<) takes a mapping or a list of mappings",
                        _line(frame[0]),
                    )
                    continue
                merged.update(source)
        merged.update(container)
        return merged

    def enter(
        self, node: yaml.Node, path: Path, depth: int, stack: list[list[Any]]
    ) -> tuple[int, Any] | None:
        """(size, value) of a scalar or an already seen node; None when a frame was
        pushed."""
        key = id(node)
        if key in self.active:
            raise _Stop(
                ErrorItem(
                    path,
                    "this alias refers to a node that contains it (a "
                    "recursive structure cannot be written as JSON)",
                    self.linemap.get(path),
                )
            )
        if key in self.sizes:
            self.aliased += self.sizes[key]
            if self.aliased > MAX_ALIAS_NODES:
                raise _Stop(
                    ErrorItem(
                        path,
                        f"YAML aliases expand this document by more than "
                        f"{MAX_ALIAS_NODES:,} nodes (an alias bomb?)",
                        self.linemap.get(path),
                    )
                )
            return self.sizes[key], self.values.get(key)
        if depth > MAX_DEPTH:
            raise _Stop(
                ErrorItem(
                    path[: MAX_DEPTH // 4], f"nested more than {MAX_DEPTH} levels deep", _line(node)
                )
            )
        if isinstance(node, yaml.ScalarNode):
            value = self.scalar(node, path)
            self.sizes[key] = 1
            self.values[key] = value
            return 1, value
        self.collection_tag(node, path)
        self.active.add(key)
        if isinstance(node, yaml.MappingNode):
            children: Any = self.pairs(node, path)
            container: Any = {}
        else:
            children = ((i, item, None) for i, item in enumerate(node.value))
            container = []
        stack.append([node, path, depth, children, 1, container, []])
        return None

    def pairs(self, node: yaml.MappingNode, path: Path) -> Any:
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = _line(key_node)
            if key_node.tag == _MERGE:
                yield _MergeKey("<<"), value_node, line
                continue
            key = self.key(key_node, path, line)
            if key is None:
                text = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                yield _BadKey(text), value_node, line  # still checked, and counted
                continue
            if key in seen:
                self.problem(
                    (*path, key),
                    f"duplicate key {shown(key)} (first set on line {seen[key]})",
                    line,
                )
                continue
            seen[key] = line
            self.linemap[(*path, key)] = line
            yield key, value_node, line

    def key(self, node: yaml.Node, path: Path, line: int) -> str | None:
        """The key's text, or None (with a problem) when it is not a string."""
        if not isinstance(node, yaml.ScalarNode):
            kind = "a mapping" if isinstance(node, yaml.MappingNode) else "a list"
            self.problem(path, f"keys must be strings, got {kind}", line)
            return None
        if node.tag == f"{_TAG}str" or self.json_text:
            return node.value
        value = _construct(node)
        message = f"keys must be strings, got {describe(value)}"
        if _surprising(node):
            message += (
                f": YAML reads the unquoted key {node.value} as "
                f'{describe(value).split(" (")[0]}; quote it, "{node.value}"'
            )
        self.problem(path, message, line)
        return None

    def collection_tag(self, node: yaml.Node, path: Path) -> None:
        tag = node.tag
        if tag in (f"{_TAG}map", f"{_TAG}seq"):
            return
        kind = _NOT_JSON.get(tag.removeprefix(_TAG))
        what = kind or f"tag {tag}"
        self.problem(
            path,
            f"{what} is not a JSON value: kvcompose configs hold plain JSON "
            "(mappings, lists, strings, numbers, booleans, null)",
            _line(node),
        )

    def scalar(self, node: yaml.ScalarNode, path: Path) -> Any:
        """The scalar's value (None where a problem was reported)."""
        text, tag, line = node.value, node.tag, _line(node)
        if self.json_text:
            if not node.style:
                self.json_number(text, path, line)
            return None
        if tag == f"{_TAG}str":
            return text
        if tag == f"{_TAG}null":
            return None
        if tag == f"{_TAG}bool":
            if not node.style and text not in _JSON_BOOL:
                self.linemap.hints[path] = text
            return _BOOLS[text.lower()]
        if tag == f"{_TAG}int":
            digits = sum(c.isdigit() for c in text)
            if digits > MAX_INT_DIGITS:
                self.problem(
                    path,
                    f"integer with {digits} digits is too large (at most {MAX_INT_DIGITS})",
                    line,
                )
                return None
            if _JSON_INT.fullmatch(text):
                return int(text)
            if not node.style:
                self.linemap.hints[path] = text
            return self.constructor.construct_yaml_int(node)
        if tag == f"{_TAG}float":
            if _JSON_FLOAT.fullmatch(text):
                value = float(text)
            else:
                if not node.style:
                    self.linemap.hints[path] = text
                value = self.constructor.construct_yaml_float(node)
            if not math.isfinite(value):
                self.problem(
                    path,
                    f"{text} is not a JSON value (NaN and infinities have no "
                    "JSON form); quote it if you meant the text",
                    line,
                )
                return None
            return value
        kind = _NOT_JSON.get(tag.removeprefix(_TAG))
        if kind == "a date":
            self.problem(
                path,
                f"YAML reads the unquoted {text} as a date, which is not a JSON "
                f'value: quote it, "{text}"',
                line,
            )
        else:
            self.problem(
                path,
                f"{kind or 'tag ' + tag} is not a JSON value: kvcompose "
                "configs hold plain JSON (use a string)",
                line,
            )
        return None

    def json_number(self, text: str, path: Path, line: int) -> None:
        if text in ("NaN", "Infinity", "-Infinity"):
            self.problem(
                path, f"{text} is not valid JSON (NaN and infinities have no JSON form)", line
            )
        elif _JSON_NUMBER.fullmatch(text):
            digits = sum(c.isdigit() for c in text)
            if digits > MAX_INT_DIGITS and _JSON_INT.fullmatch(text):
                self.problem(
                    path,
                    f"integer with {digits} digits is too large (at most {MAX_INT_DIGITS})",
                    line,
                )
            elif not _JSON_INT.fullmatch(text) and not math.isfinite(float(text)):
                self.problem(path, f"number {shown(text)} is too large", line)


def _surprising(node: yaml.ScalarNode) -> bool:
    """An unquoted scalar that YAML 1.1 reads otherwise than JSON and YAML 1.2 would
    (``on``/``no`` as booleans, ``0123`` as octal, ``1:30`` in base 60, ``1_000``)."""
    if node.style:
        return False
    text, tag = node.value, node.tag.removeprefix(_TAG)
    return (
        (tag == "bool" and text not in _JSON_BOOL)
        or (tag == "int" and not _JSON_INT.fullmatch(text))
        or (tag == "float" and not _JSON_FLOAT.fullmatch(text))
    )


def _construct(node: yaml.ScalarNode) -> Any:
    try:
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except Exception:
        return node.value
