"""Reading YAML and JSON files into plain data plus a map from document paths to lines."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvcompose.config.errors import ConfigError, ErrorItem, Path


@dataclass
class Source:
    """A parsed document: the data, where it came from, and the line of each path."""

    data: Any
    label: str | None = None
    linemap: dict[Path, int] = field(default_factory=dict)
    path: str | None = None  # the file, when there is one


def read_file(path: str | os.PathLike) -> Source:
    """Parse a YAML (``.yaml``/``.yml``/anything else) or JSON (``.json``) file."""
    label = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError("no such file", label) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file", label) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", label) from None
    try:
        if label.lower().endswith(".json"):
            return parse_json(text, label)
        return parse_yaml(text, label)
    except RecursionError:
        raise ConfigError("nested too deeply", label) from None


def parse_json(text: str, label: str | None = None) -> Source:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(ErrorItem((), f"JSON syntax error: {exc.msg} (column {exc.colno})",
                                    exc.lineno), label) from None
    linemap: dict[Path, int] = {}
    try:  # JSON is (nearly) YAML: reuse the YAML composer for line numbers
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _walk(node, (), linemap, dupes=None)
    except yaml.YAMLError:
        linemap = {}
    return Source(data, label, linemap, label)


def parse_yaml(text: str, label: str | None = None) -> Source:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(exc), label) from None
    if node is None:
        raise ConfigError("empty document", label)
    linemap: dict[Path, int] = {}
    dupes: list[ErrorItem] = []
    _walk(node, (), linemap, dupes)
    if dupes:
        raise ConfigError(dupes, label)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # pragma: no cover - compose already succeeded
        raise ConfigError(_yaml_error(exc), label) from None
    return Source(data, label, linemap, label)


def _yaml_error(exc: yaml.YAMLError) -> ErrorItem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    text = f"YAML syntax error: {problem}"
    if context:
        text += f" ({context})"
    line = mark.line + 1 if mark is not None else None
    if mark is not None:
        text += f" (column {mark.column + 1})"
    return ErrorItem((), text, line)


def _walk(node: yaml.Node, path: Path, linemap: dict[Path, int],
          dupes: list[ErrorItem] | None, depth: int = 0) -> None:
    if depth > 200:  # recursive aliases
        return
    linemap.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key == "<<":
                continue
            line = key_node.start_mark.line + 1
            if key in seen and dupes is not None:
                dupes.append(ErrorItem((*path, key), f"duplicate key {key!r} "
                                       f"(first set on line {seen[key]})", line))
            seen.setdefault(key, line)
            linemap[(*path, key)] = line
            _walk(value_node, (*path, key), linemap, dupes, depth + 1)
            linemap[(*path, key)] = line  # the key's line, not the value's
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), linemap, dupes, depth + 1)
