"""``Config``: a loaded config, the tree plus what the CLI needs to explain and print it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcompose.config.compile import NodeInfo
from kvcompose.config.errors import ConfigError, Path, located
from kvcompose.config.paths import SAME, PathMap
from kvcompose.tree import VERSION, Node


@dataclass(frozen=True)
class Config:
    """A loaded config: the tree plus what the CLI needs to explain and print it.

    ``tree`` is what the composite runs: every node named, every leaf holding the
    document's top-level ``KVTransferConfig`` fields it does not set itself. ``document`` is the
    normalised user-format document (every node named, overrides applied).
    """

    tree: Node
    document: dict[str, Any] | None = None
    transfer: dict[str, Any] = field(default_factory=dict)  # top-level KVTransferConfig fields
    hma: bool | None = None  # None: auto
    version: int = VERSION
    label: str | None = None
    path: str | None = None  # the file, when the config came from one
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()  # applied overrides, in order
    origin: str = "document"  # document | multiconnector | kvcompose-args | internal
    #: When the input was a ``--kv-transfer-config``: its ``kv_connector`` and module path.
    loaded_as: tuple[str, str | None] | None = None
    linemap: Mapping[Path, int] | None = field(default=None, repr=False, compare=False)
    #: Where each document path is in the input that was read.
    translate: PathMap = field(default=SAME, repr=False, compare=False)
    facts: Any = field(default=None, repr=False, compare=False)  # VllmFacts, when checked

    def error(self, path: Path, message: str) -> ConfigError:
        """A ``ConfigError`` about ``path`` (a document path), with file and line."""
        return ConfigError(located(self.linemap, self.translate(tuple(path)), message), self.label)

    def vllm_transfer(self) -> dict[str, Any]:
        """The top-level ``KVTransferConfig`` fields, for a config vLLM is to load: vLLM
        needs ``kv_role`` there (``vllm-args`` and ``convert`` alike)."""
        if "kv_role" not in self.transfer:
            raise self.error(
                ("kv_role",),
                "required to start vLLM: set kv_role at the top of the config (kv_producer, "
                "kv_consumer or kv_both)",
            )
        return dict(self.transfer)

    def leaf_paths(self) -> dict[str, Path]:
        return {n.name: n.path for n in self.nodes.values() if n.kind == "leaf"}
