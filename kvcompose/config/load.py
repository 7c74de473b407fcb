"""From user input (files, dicts, ``kv_connector_extra_config``) to a validated tree."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvcompose.config.compile import NodeInfo, Translate, compile_document
from kvcompose.config.document import document_from_tree
from kvcompose.config.env import (
    ENV_CONFIG_FILE,
    Override,
    apply_override,
    env_overrides,
    environ,
    mapping_overrides,
)
from kvcompose.config.errors import ConfigError, ErrorItem, Path, describe, line_for
from kvcompose.config.source import Source, read_file
from kvcompose.tree import NODE_KINDS, TRANSFER_FIELDS, TREE_KEY, VERSION, Node, parse_node, walk

#: Names vLLM loads the composite under.
COMPOSITE_NAMES = ("KVCompose", "KVComposeHMA")
EXTRA_CONFIG = "kv_connector_extra_config"

def _identity(path: Path) -> Path:
    return path


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
    translate: Translate = field(default=_identity, repr=False, compare=False)
    facts: Any = field(default=None, repr=False, compare=False)  # VllmFacts, when checked

    def error(self, path: Path, message: str) -> ConfigError:
        """A ``ConfigError`` about ``path`` (a document path), with file and line."""
        real = self.translate(tuple(path))
        return ConfigError(ErrorItem(real, message, line_for(self.linemap, real)), self.label)

    def leaf_paths(self) -> dict[str, Path]:
        return {n.name: n.path for n in self.nodes.values() if n.kind == "leaf"}


# --------------------------------------------------------------------------- public API


def load_config(source: str | os.PathLike | Mapping[str, Any], *,
                env: Mapping[str, str] | None = None,
                overrides: list[Override] | None = None,
                check_vllm: bool | None = None) -> Config:
    """Load and validate a config from a YAML/JSON file or a dict in the user format.

    Also accepted: a bare node (``{"chain": {...}}``), vLLM MultiConnector JSON (the whole
    ``--kv-transfer-config`` or just its ``{"connectors": [...]}``) and the KVCompose
    ``--kv-transfer-config`` that ``kvcompose vllm-args`` prints. ``env`` defaults to
    ``os.environ`` (pass ``{}`` to ignore it); ``overrides`` apply after the environment.
    ``check_vllm``: run the checks that import vLLM (default: when vLLM is installed).
    """
    env = environ(env)
    if isinstance(source, Source):  # already parsed (e.g. standard input)
        src = source
    elif isinstance(source, Mapping):
        src = Source(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        src = read_file(source)
    else:
        raise ConfigError(f"expected a file path or a mapping, got {describe(source)}")
    if not isinstance(src.data, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {describe(src.data)}",
                          src.label)
    data = dict(src.data)
    if isinstance(data.get("kv_connector"), str) and data["kv_connector"] in COMPOSITE_NAMES:
        config = _from_composite_args(data, src, env, overrides or [], check_vllm)
    else:
        config = _load(src, env_overrides(env) + list(overrides or []), check_vllm)
    if isinstance(data.get("kv_connector"), str):
        module = data.get("kv_connector_module_path")
        config = dataclasses.replace(config, loaded_as=(
            data["kv_connector"], module if isinstance(module, str) else None))
    return config


def load_tree(source: str | os.PathLike | Mapping[str, Any], *,
              env: Mapping[str, str] | None = None,
              check_vllm: bool | None = None) -> Node:
    """The validated tree of a config file (YAML/JSON) or dict; raises ``ConfigError``."""
    return load_config(source, env=env, check_vllm=check_vllm).tree


def config_from_extra_config(extra: Mapping[str, Any], *,
                             env: Mapping[str, str] | None = None,
                             check_vllm: bool | None = None) -> Config:
    """Load the tree a KVCompose connector was given in its ``kv_connector_extra_config``.

    Forms: ``{TREE_KEY: <canonical dict>}`` (internal, already validated);
    ``{"config": "tree.yaml", ...overrides}``; an inline document ``{"tree": {...}, ...}``;
    vLLM MultiConnector's ``{"connectors": [...]}``. With none of these,
    ``KVCOMPOSE_CONFIG_FILE`` names the file. Every form but the first takes a ``set``
    mapping of ``node.key`` overrides and honours the environment.
    """
    label = EXTRA_CONFIG
    if not isinstance(extra, Mapping):
        raise ConfigError(f"expected a mapping, got {describe(extra)}", label)
    if TREE_KEY in extra:
        try:
            tree = parse_node(extra[TREE_KEY])
        except ValidationError as exc:  # internal form: a bug elsewhere if this fails
            raise ConfigError(f"{TREE_KEY}: malformed internal tree ({exc.error_count()} "
                              f"problems, first: {exc.errors()[0]['msg']})", label) from None
        return Config(tree=tree, label=label, origin="internal",
                      nodes={n.name: NodeInfo(n.name, n.kind, (), None, None)  # type: ignore[arg-type]
                             for _, n in walk(tree)})
    env = environ(env)
    src, late, _ = _split_extra(dict(extra), env, Source({}, label), ())
    return _load(src, env_overrides(env) + late, check_vllm)


def tree_from_extra_config(extra: Mapping[str, Any], *,
                           env: Mapping[str, str] | None = None,
                           check_vllm: bool | None = None) -> Node:
    """The tree for a KVCompose connector's ``kv_connector_extra_config`` (see
    ``config_from_extra_config`` for the accepted forms)."""
    return config_from_extra_config(extra, env=env, check_vllm=check_vllm).tree


def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- pipeline


def _split_extra(extra: dict[str, Any], env: Mapping[str, str], outer: Source,
                 prefix: Path) -> tuple[Source, list[Override], bool]:
    """Where the document of an extra config comes from (and whether it is inline), and the
    override keys given next to it."""
    label = outer.label or EXTRA_CONFIG
    inline = Source(extra, label, outer.linemap, outer.path)
    late: list[Override] = []
    if "set" in extra:
        late = mapping_overrides(extra.pop("set"), _dotted(prefix, "set"))
    has_tree = "connectors" in extra or "tree" in extra or any(k in extra for k in NODE_KINDS)
    if has_tree and "config" not in extra:
        return inline, late, True
    if "config" in extra:
        path = extra.pop("config")
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigError(ErrorItem((*prefix, "config"),
                                        f"expected a file path, got {describe(path)}",
                                        line_for(outer.linemap, (*prefix, "config"))), label)
        top = [Override(_dotted(prefix, key), key, value) for key, value in extra.items()]
        return read_file(path), top + late, False
    if env.get(ENV_CONFIG_FILE):
        top = [Override(_dotted(prefix, key), key, value) for key, value in extra.items()]
        return read_file(env[ENV_CONFIG_FILE]), top + late, False
    got = ", ".join(repr(k) for k in extra) or "none"
    raise ConfigError(ErrorItem(prefix, "no tree given: expected 'tree' (an inline tree), "
                                "'config' (a file path) or 'connectors' (MultiConnector form), "
                                f"or set {ENV_CONFIG_FILE}; got keys: {got}",
                                line_for(outer.linemap, prefix)), label)


def _dotted(prefix: Path, key: str) -> str:
    return ".".join([*(str(p) for p in prefix), key]) if prefix else f"{EXTRA_CONFIG}.{key}"


def _from_composite_args(data: dict[str, Any], src: Source, env: Mapping[str, str],
                         overrides: list[Override], check_vllm: bool | None) -> Config:
    """A KVCompose ``--kv-transfer-config`` (what ``vllm-args`` prints)."""
    extra = data.get(EXTRA_CONFIG)
    if not isinstance(extra, Mapping):
        raise ConfigError(ErrorItem((EXTRA_CONFIG,), f"expected a mapping, got "
                                    f"{describe(extra)}", line_for(src.linemap, (EXTRA_CONFIG,))),
                          src.label)
    parent = {k: v for k, v in data.items() if k in TRANSFER_FIELDS and v is not None}
    if TREE_KEY in extra:  # the internal form, in a file: validate it like any document
        tree = config_from_extra_config({TREE_KEY: extra[TREE_KEY]}, env={}).tree
        doc = document_from_tree(tree, parent)
        if extra.get("strict"):
            doc["strict"] = True
        return _load(Source(doc, src.label, None, src.path),
                     env_overrides(env) + list(overrides), check_vllm, origin="internal")
    inner, late, inline = _split_extra(dict(extra), env, src, (EXTRA_CONFIG,))
    everything = env_overrides(env) + late + list(overrides)
    if not isinstance(inner.data, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {describe(inner.data)}",
                          inner.label)
    merged = Source({**parent, **inner.data}, inner.label, inner.linemap, inner.path)
    if not inline:
        return _load(merged, everything, check_vllm)

    def translate(path: Path) -> Path:
        if path and path[0] in parent and path[0] not in inner.data:
            return path
        return (EXTRA_CONFIG, *path)

    return _load(merged, everything, check_vllm, translate=translate, origin="kvcompose-args")


def _load(src: Source, overrides: list[Override], check_vllm: bool | None, *,
          translate: Translate = _identity, origin: str = "document") -> Config:
    data = src.data
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping at the top level, got {describe(data)}",
                          src.label)
    data = dict(data)
    if data and set(data) <= set(NODE_KINDS):
        data = {"tree": data}  # a bare node
        inner = translate

        def translate(path: Path, inner: Translate = inner) -> Path:
            return inner(path[1:] if path[:1] == ("tree",) else path)
    elif (("connectors" in data and "tree" not in data)
          or data.get("kv_connector") == "MultiConnector"):
        from kvcompose.config.multiconnector import document_from_multiconnector

        data, translate = document_from_multiconnector(data, translate, src)
        origin = "multiconnector"
    elif "kv_connector" in data and "tree" not in data:
        raise ConfigError(ErrorItem(translate(("kv_connector",)),
                                    f"{data['kv_connector']!r} is a single connector: kvcompose "
                                    "reads its own documents, KVCompose and MultiConnector "
                                    "configs", line_for(src.linemap, ("kv_connector",))),
                          src.label)
    compiled = compile_document(data, src.label, src.linemap, translate)
    applied: list[str] = []
    for override in overrides:
        document = apply_override(compiled.document, override)
        try:
            compiled = compile_document(document, override.source, None, _identity)
        except ConfigError as exc:
            raise exc.relabel(override.source) from None
        applied.append(override.source)
    config = Config(
        tree=compiled.tree, document=compiled.document, transfer=compiled.transfer,
        hma=compiled.hma, version=compiled.version, label=src.label, path=src.path,
        nodes=compiled.nodes, warnings=tuple(compiled.warnings), overrides=tuple(applied),
        origin=origin, linemap=src.linemap, translate=translate)
    if check_vllm is None:
        check_vllm = vllm_available()
    if check_vllm:
        from kvcompose.config.vllm_checks import inspect_config

        facts = inspect_config(config)
        config = dataclasses.replace(config, facts=facts,
                                     warnings=config.warnings + tuple(facts.warnings()))
    return config
