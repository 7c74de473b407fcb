"""``PathMap``: where a path of the kvcompose document is in the input that was read.

kvcompose compiles one document form, but reads several shapes of input (a bare node,
MultiConnector JSON, a KVCompose ``--kv-transfer-config``, the inline tree of a nested leaf).
An error found in the document names the path the user wrote, on its line: the map says
where each document path came from. It is a value, not a function, so a ``Config`` can keep
it and place the errors found later (vLLM's checks, ``convert``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompose.config.errors import Path
from kvcompose.config.messages import LEAF_KEYS

_FROM_LEAF = {v: k for k, v in LEAF_KEYS.items()}
#: Where a nested MultiConnector keeps its ``connectors``: its leaf's extra config.
_NESTED = _FROM_LEAF["extra_config"]


@dataclass(frozen=True)
class PathMap:
    """Document path -> input path, applied inside out:

    - ``bare``: the input is a bare node, the document's ``tree`` key is not in it;
    - ``connectors_at``: the input is MultiConnector JSON with its ``connectors`` list under
      this path; the document's chain of leaves is that list (``connectors_path``);
    - ``prefix``: the document sits under this path of the input, except the top-level
      keys in ``outside`` (a KVCompose ``--kv-transfer-config``'s own fields, which sit
      next to its extra config).
    """

    prefix: Path = ()
    outside: frozenset[str] = frozenset()
    bare: bool = False
    connectors_at: Path | None = None

    def __call__(self, path: Path) -> Path:
        if self.bare and path[:1] == ("tree",):
            path = path[1:]
        if self.connectors_at is not None:
            path = connectors_path(path, self.connectors_at)
        if path and path[0] in self.outside:
            return path
        return (*self.prefix, *path)


def connectors_path(path: Path, prefix: Path) -> Path:
    """``tree.chain.children[i].leaf.connector`` -> ``connectors[i].kv_connector`` (the
    ``connectors`` list under ``prefix``; a nested chain is a nested MultiConnector)."""
    if path[:2] != ("tree", "chain"):
        if path[:1] == ("tree",):
            return (*prefix, "connectors")
        return path
    out = prefix
    rest = path[2:]
    while rest:
        if rest[0] != "children":
            return out
        out = (*out, "connectors")
        if len(rest) < 2:
            return out
        out = (*out, rest[1])
        rest = rest[2:]
        if not rest:
            return out
        if rest[0] == "chain":
            out = (*out, _NESTED)
            rest = rest[1:]
            continue
        rest = rest[1:]  # "leaf"
        if not rest:
            return out
        key = rest[0]
        if key == "transfer_config":
            return out + tuple(rest[1:2])
        return (*out, _FROM_LEAF.get(key, key), *rest[1:])
    return out


#: The input is the document, path for path.
SAME = PathMap()
