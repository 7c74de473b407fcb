"""Parsing YAML and JSON text into data and the line of every key and item, in one parse.

libyaml composes the text (``yaml.CSafeLoader``; PyYAML's own parser when libyaml is
missing) and PyYAML's safe constructor builds the data, sharing what aliases share and
applying merge keys (``<<``) as ``yaml.safe_load`` does. The loaders below change what a
config needs changed:

- each mapping and list records the line of each key and item (``Marks``), and the text of
  the unquoted scalars YAML 1.1 reads as something else than they look (``no``, ``0123``);
- a duplicate key is recorded, not silently overwritten;
- what is not JSON (dates, ``!!binary``, sets, unknown tags, ``.nan``, keys that are not
  strings, integers too long to convert) becomes a ``NotJson`` marker in the data.

Nothing is refused here that needs a path: ``walk.check_plain`` walks the data once, maps
each path to its line, and reports the markers, depth, aliases and duplicates.

JSON is YAML's flow style with JSON's scalars, so ``JsonLoader`` reads it with the same
parser and refuses, with its line and column, the YAML a ``.json`` file must not hold:
unquoted or single-quoted text, block style, tags, aliases and trailing commas (which
``json.loads``, and so vLLM's ``--kv-transfer-config``, refuses). ``1e5`` is a number and
``NaN`` is refused there, as JSON says; comments are let through.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvcompose.config.limits import MAX_DEPTH, MAX_INT_DIGITS
from kvcompose.tree.error_messages import key_not_string, shown

_TAG = "tag:yaml.org,2002:"
_MERGE = f"{_TAG}merge"
_STR = f"{_TAG}str"
#: How JSON spells its scalars; an unquoted YAML scalar spelled otherwise may surprise.
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_JSON_FLOAT = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_JSON_BOOL = frozenset({"true", "false", "True", "False", "TRUE", "FALSE"})
_TRAILING_COMMA = re.compile(r"\s*,(?:\s|#[^\n]*)*[}\]]")
_NOT_FINITE = frozenset({".inf", "-.inf", "+.inf", ".nan", "nan", "infinity", "-infinity"})
_NOT_JSON = {
    "timestamp": "a date",
    "binary": "!!binary data",
    "set": "a !!set",
    "omap": "an !!omap",
    "pairs": "a !!pairs list",
}
_PLAIN_JSON = "kvcompose configs hold plain JSON"
#: The refusals ``walk`` words the same way for data handed over in Python.
TOO_MANY_DIGITS = f"integer is too large (more than {MAX_INT_DIGITS} digits)"
NOT_FINITE = "is not a JSON value (NaN and infinities have no JSON form)"
TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"

_Base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class NotJson:
    """Stands in the data for a value (or a key) a config must not hold; the walk reports
    ``message`` at its path. Hashed by identity, so two bad keys never collide."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


@dataclass
class Marks:
    """Where a document's keys and items were read, by ``id`` of their mapping or list."""

    root: int | None = None  # the line of the document; None for data not read from text
    lines: dict[int, dict[Any, int]] = field(default_factory=dict)
    #: what YAML 1.1 made of the unquoted values it read as a boolean or a number
    hints: dict[int, dict[Any, str]] = field(default_factory=dict)
    #: (key, line, line where it was first set) of each repeated key
    duplicates: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)


def read(text: str, json: bool = False) -> tuple[Any, Marks] | None:
    """The data of ``text`` and its marks; None for an empty document. Raises
    ``yaml.YAMLError`` for a syntax error and ``RecursionError`` for pathological nesting."""
    loader = (JsonLoader if json else YamlLoader)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        loader.doc_marks.root = node.start_mark.line + 1
        return loader.construct_document(node), loader.doc_marks
    finally:
        loader.dispose()


def _expect(node: yaml.Node, kind: type[yaml.Node]) -> None:
    """A tag of the wrong kind (``!!map [1]``) is a clean error, as in PyYAML."""
    if not isinstance(node, kind):
        raise yaml.constructor.ConstructorError(
            None, None, f"expected a {kind.id} node, but found {node.id}", node.start_mark
        )


def _surprise(node: yaml.Node) -> str | None:
    """What YAML 1.1 made of an unquoted scalar it reads otherwise than JSON and YAML 1.2
    would (``on``/``no`` as booleans, ``0123`` as octal, ``1:30`` in base 60, ``1_000``)."""
    if not isinstance(node, yaml.ScalarNode) or node.style:
        return None
    text, tag = node.value, node.tag.removeprefix(_TAG)
    if (
        (tag == "bool" and text not in _JSON_BOOL)
        or (tag == "int" and not _JSON_INT.fullmatch(text.lstrip("+")))
        or (tag == "float" and not _JSON_FLOAT.fullmatch(text))
    ):
        return _read_as(node, "a boolean" if tag == "bool" else "a number")
    return None


def _read_as(node: yaml.ScalarNode, kind: str) -> str:
    """The one wording of a YAML 1.1 surprise (see ``errors.located``)."""
    text = node.value
    return f'YAML reads the unquoted {text} as {kind}: quote it, "{text}", if you meant the text'


class YamlLoader(_Base):  # type: ignore[misc]
    """``yaml.CSafeLoader`` that records lines and duplicates and marks what is not JSON."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.doc_marks = Marks()  # not "marks": PyYAML's own parser has a list of that name
        self._own: dict[int, int] = {}  # id(mapping node) -> pairs written in it (no merges)

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # PyYAML puts the merged pairs first and drops the ``<<`` keys, in the node itself
        # (a merge source too): count the node's own pairs before that happens.
        self._own.setdefault(id(node), sum(1 for key, _ in node.value if key.tag != _MERGE))
        super().flatten_mapping(node)

    def construct_yaml_map(self, node: yaml.Node) -> Any:
        _expect(node, yaml.MappingNode)
        data: dict[Any, Any] = {}
        yield data
        merged = 0
        if id(node) in self._own or any(key.tag == _MERGE for key, _ in node.value):
            self.flatten_mapping(node)
            merged = len(node.value) - self._own[id(node)]
        lines: dict[Any, int] = {}
        own: dict[Any, int] = {}  # a merged key may be set again, an own key may not
        for index, (key_node, value_node) in enumerate(node.value):
            key = self.construct_key(key_node)
            line = key_node.start_mark.line + 1
            if index >= merged:
                if key in own:
                    self.doc_marks.duplicates.setdefault(id(data), []).append((key, line, own[key]))
                    continue
                own[key] = line
            data[key] = self.construct_child(value_node, id(data), key)
            lines[key] = line
        self.doc_marks.lines[id(data)] = lines

    def construct_yaml_seq(self, node: yaml.Node) -> Any:
        _expect(node, yaml.SequenceNode)
        data: list[Any] = []
        yield data
        lines: dict[Any, int] = {}
        for index, child in enumerate(node.value):
            data.append(self.construct_child(child, id(data), index))
            lines[index] = child.start_mark.line + 1
        self.doc_marks.lines[id(data)] = lines

    def construct_child(self, node: yaml.Node, parent: int, key: Any) -> Any:
        """A mapping's value or a list's item: text at once (most of a config), anything
        else by its constructor, with a hint when YAML 1.1 read it otherwise than it looks."""
        if node.tag == _STR and type(node) is yaml.ScalarNode and self.text_ok(node):
            return node.value
        surprise = _surprise(node)
        if surprise:
            self.doc_marks.hints.setdefault(parent, {})[key] = surprise
        return self.construct_object(node)

    def text_ok(self, node: yaml.ScalarNode) -> bool:
        return True

    def construct_key(self, node: yaml.Node) -> Any:
        """A mapping key: its text, or a ``NotJson`` saying why it is no string."""
        if not isinstance(node, yaml.ScalarNode):
            return NotJson(key_not_string({} if isinstance(node, yaml.MappingNode) else []))
        if node.tag == _STR and self.text_ok(node):
            return node.value
        key = self.construct_object(node)
        if isinstance(key, (str, NotJson)):
            return key
        message, surprise = key_not_string(key), _surprise(node)
        return NotJson(f"{message} ({surprise})" if surprise else message)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        # Python refuses to convert thousands of digits, or takes quadratic time
        if sum(c.isdigit() for c in node.value) > MAX_INT_DIGITS:
            return NotJson(TOO_MANY_DIGITS)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.ScalarNode) -> Any:
        value = super().construct_yaml_float(node)
        if math.isfinite(value):
            return value
        if node.value.lower() in _NOT_FINITE:
            return NotJson(f"{node.value} {NOT_FINITE}; quote it if you meant the text")
        return NotJson(f"number {shown(node.value)} is too large")

    def construct_not_json(self, node: yaml.Node) -> NotJson:
        kind = _NOT_JSON.get(node.tag.removeprefix(_TAG)) or f"tag {node.tag}"
        if kind == "a date":
            return NotJson(_read_as(node, "a date, which is not a JSON value"))
        if isinstance(node, yaml.ScalarNode):
            return NotJson(f"{kind} is not a JSON value: {_PLAIN_JSON} (use a string)")
        return NotJson(
            f"{kind} is not a JSON value: {_PLAIN_JSON} "
            "(mappings, lists, strings, numbers, booleans, null)"
        )


YamlLoader.add_constructor(f"{_TAG}map", YamlLoader.construct_yaml_map)
YamlLoader.add_constructor(f"{_TAG}seq", YamlLoader.construct_yaml_seq)
YamlLoader.add_constructor(f"{_TAG}int", YamlLoader.construct_yaml_int)
YamlLoader.add_constructor(f"{_TAG}float", YamlLoader.construct_yaml_float)
for _tag in (*_NOT_JSON, None):
    YamlLoader.add_constructor(f"{_TAG}{_tag}" if _tag else None, YamlLoader.construct_not_json)


class JsonLoader(YamlLoader):
    """JSON text: JSON's scalars, and no YAML beyond JSON's (see the module docstring)."""

    yaml_implicit_resolvers: dict[Any, Any] = {}  # PyYAML's class table: JSON's, below

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        problem = self.not_json(node)
        if problem:
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark)
        return super().construct_object(node, deep=deep)

    def text_ok(self, node: yaml.ScalarNode) -> bool:
        return node.style == '"'

    def not_json(self, node: yaml.Node) -> str | None:
        """Why ``node`` is YAML that JSON does not have, or None."""
        if node in self.constructed_objects:
            return "an alias (*name) is YAML, not JSON"
        if isinstance(node, yaml.ScalarNode):
            plain = not node.style  # libyaml: "", PyYAML: None
            if node.tag == _STR and node.style != '"':
                if plain:
                    return f"unquoted text {shown(node.value)}: JSON strings are in double quotes"
                kind = "single-quoted" if node.style == "'" else "YAML block"
                return f"a {kind} string: JSON strings are in double quotes"
            if node.tag != _STR and not plain:
                return f"a tag ({node.tag}) is YAML, not JSON"
            return None
        if not node.flow_style:
            return "a YAML block mapping or list: JSON writes them in {} and []"
        if node.value:
            last = node.value[-1][1] if isinstance(node, yaml.MappingNode) else node.value[-1]
            gap = self.text[last.end_mark.index : node.end_mark.index]
            if _TRAILING_COMMA.fullmatch(gap):
                comma = last.end_mark.index + gap.index(",")
                raise yaml.constructor.ConstructorError(
                    None, None, "a trailing comma is not JSON", _mark(self.text, comma)
                )
        return None


def _mark(text: str, index: int) -> yaml.Mark:
    line_start = text.rfind("\n", 0, index) + 1
    return yaml.Mark("<json>", index, text.count("\n", 0, index), index - line_start, None, None)


for _tag, _pattern, _first in (
    ("null", "null", "n"),
    ("bool", "true|false", "tf"),
    ("int", _JSON_INT.pattern, "-0123456789"),
    ("float", f"{_JSON_FLOAT.pattern}|NaN|-?Infinity", "-0123456789NI"),
):
    JsonLoader.add_implicit_resolver(f"{_TAG}{_tag}", re.compile(f"^(?:{_pattern})$"), list(_first))
