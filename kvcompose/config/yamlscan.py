"""One pass over a composed YAML node graph, before anything is built from it.

It maps every document path to its line, and refuses what would go wrong later: duplicate
keys, keys that are not strings, values that are not JSON (dates, ``!!binary``, ``.nan``,
sets), integers too long to convert, nesting beyond ``MAX_DEPTH``, aliases that refer to
themselves or expand beyond ``MAX_ALIAS_NODES``. The walk visits each node once (memo on
node identity) and never follows an alias into a node it has already seen, so an alias bomb
costs what its text costs.

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
    """The line map of a composed document; raises ``ConfigError`` for what it refuses."""
    walk = _Walk(json_text)
    try:
        walk.run(root)
    except _Stop as stop:
        raise ConfigError([stop.item], label) from None
    if walk.problems:
        raise ConfigError(walk.problems, label)
    return walk.linemap


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


class _Walk:
    def __init__(self, json_text: bool):
        self.json_text = json_text
        self.linemap = LineMap()
        self.problems: list[ErrorItem] = []
        self.sizes: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self.active: set[int] = set()  # nodes on the current path
        self.aliased = 0  # nodes that aliases add

    def problem(self, path: Path, message: str, line: int | None) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(ErrorItem(path, message, line))

    def run(self, root: yaml.Node) -> None:
        # frames: [node, path, depth, iterator of (key path, child node, key line), size]
        self.linemap.setdefault((), _line(root))
        stack: list[list[Any]] = []
        size = self.enter(root, (), 0, stack)
        if size is not None:  # a lone scalar
            return
        while stack:
            frame = stack[-1]
            step = next(frame[3], None)
            if step is None:
                stack.pop()
                self.active.discard(id(frame[0]))
                self.sizes[id(frame[0])] = frame[4]
                if stack:
                    stack[-1][4] += frame[4]
                continue
            path, child, line = step
            self.linemap.setdefault(path, line if line is not None else _line(child))
            size = self.enter(child, path, frame[2] + 1, stack)
            if size is not None:
                frame[4] += size

    def enter(self, node: yaml.Node, path: Path, depth: int, stack: list[list[Any]]
              ) -> int | None:
        """The size of a scalar or an already seen node; None when a frame was pushed."""
        key = id(node)
        if key in self.active:
            raise _Stop(ErrorItem(path, "this alias refers to a node that contains it (a "
                                        "recursive structure cannot be written as JSON)",
                                  self.linemap.get(path)))
        if key in self.sizes:
            self.aliased += self.sizes[key]
            if self.aliased > MAX_ALIAS_NODES:
                raise _Stop(ErrorItem(path, f"YAML aliases expand this document by more than "
                                            f"{MAX_ALIAS_NODES:,} nodes (an alias bomb?)",
                                      self.linemap.get(path)))
            return self.sizes[key]
        if depth > MAX_DEPTH:
            raise _Stop(ErrorItem(path[:MAX_DEPTH // 4], f"nested more than {MAX_DEPTH} levels "
                                                         "deep", _line(node)))
        if isinstance(node, yaml.ScalarNode):
            self.scalar(node, path)
            self.sizes[key] = 1
            return 1
        self.collection_tag(node, path)
        self.active.add(key)
        children = (self.pairs(node, path) if isinstance(node, yaml.MappingNode)
                    else (((*path, i), item, None) for i, item in enumerate(node.value)))
        stack.append([node, path, depth, iter(children), 1])
        return None

    def pairs(self, node: yaml.MappingNode, path: Path) -> Any:
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = _line(key_node)
            if key_node.tag == _MERGE:
                yield (*path, "<<"), value_node, line
                continue
            key = self.key(key_node, path, line)
            if key is None:
                continue
            if key in seen:
                self.problem((*path, key), f"duplicate key {shown(key)} (first set on line "
                                           f"{seen[key]})", line)
                continue
            seen[key] = line
            self.linemap[(*path, key)] = line
            yield (*path, key), value_node, line

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
        if node.style is None and node.tag in _PLAIN_TAGS:
            message += (f": YAML reads the unquoted key {node.value} as "
                        f"{describe(value).split(' (')[0]}; quote it, \"{node.value}\"")
        self.problem(path, message, line)
        return None

    def collection_tag(self, node: yaml.Node, path: Path) -> None:
        tag = node.tag
        if tag in (f"{_TAG}map", f"{_TAG}seq"):
            return
        kind = _NOT_JSON.get(tag.removeprefix(_TAG))
        what = kind or f"tag {tag}"
        self.problem(path, f"{what} is not a JSON value: kvcompose configs hold plain JSON "
                           "(mappings, lists, strings, numbers, booleans, null)", _line(node))

    def scalar(self, node: yaml.ScalarNode, path: Path) -> None:
        text, tag, line = node.value, node.tag, _line(node)
        if self.json_text:
            if node.style is None:
                self.json_number(text, path, line)
            return
        if tag == f"{_TAG}str" or tag == f"{_TAG}null":
            return
        if tag == f"{_TAG}int":
            digits = sum(c.isdigit() for c in text)
            if digits > MAX_INT_DIGITS:
                self.problem(path, f"integer with {digits} digits is too large (at most "
                                   f"{MAX_INT_DIGITS})", line)
            elif node.style is None and not _JSON_INT.fullmatch(text):
                self.linemap.hints[path] = text
            return
        if tag == f"{_TAG}float":
            try:
                finite = math.isfinite(float(text.replace("_", "")))
            except ValueError:  # 1:30.5 (base 60): finite, and surprising
                finite = True
            if text.lower().lstrip("+-") in (".nan", ".inf") or not finite:
                self.problem(path, f"{text} is not a JSON value (NaN and infinities have no "
                                   "JSON form); quote it if you meant the text", line)
            elif node.style is None and not _JSON_FLOAT.fullmatch(text):
                self.linemap.hints[path] = text
            return
        if tag == f"{_TAG}bool":
            if node.style is None and text not in _JSON_BOOL:
                self.linemap.hints[path] = text
            return
        kind = _NOT_JSON.get(tag.removeprefix(_TAG))
        if kind == "a date":
            self.problem(path, f"YAML reads the unquoted {text} as a date, which is not a JSON "
                               f"value: quote it, \"{text}\"", line)
        else:
            self.problem(path, f"{kind or 'tag ' + tag} is not a JSON value: kvcompose "
                               "configs hold plain JSON (use a string)", line)

    def json_number(self, text: str, path: Path, line: int) -> None:
        if text in ("NaN", "Infinity", "-Infinity"):
            self.problem(path, f"{text} is not valid JSON (NaN and infinities have no JSON "
                               "form)", line)
        elif _JSON_NUMBER.fullmatch(text):
            digits = sum(c.isdigit() for c in text)
            if digits > MAX_INT_DIGITS and _JSON_INT.fullmatch(text):
                self.problem(path, f"integer with {digits} digits is too large (at most "
                                   f"{MAX_INT_DIGITS})", line)
            elif not _JSON_INT.fullmatch(text) and not math.isfinite(float(text)):
                self.problem(path, f"number {shown(text)} is too large", line)


def _construct(node: yaml.ScalarNode) -> Any:
    try:
        return yaml.constructor.SafeConstructor().construct_object(node, deep=True)
    except Exception:
        return node.value
