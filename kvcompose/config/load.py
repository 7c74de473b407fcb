"""From user input (files, dicts, ``kv_connector_extra_config``) to validated node specs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvcompose import spec as specs
from kvcompose.config.env import (
    ENV_CONFIG_FILE,
    Override,
    apply_override,
    env_overrides,
    environ,
    mapping_overrides,
)
from kvcompose.config.errors import (
    ConfigError,
    ErrorItem,
    Path,
    describe,
    did_you_mean,
    line_for,
)
from kvcompose.config.messages import items_from_validation
from kvcompose.config.schema import (
    NODE_KINDS,
    TRANSFER_FIELDS,
    VERSION,
    ChainModel,
    Document,
    FanoutModel,
    LeafModel,
    NodeEntry,
    RouteModel,
)
from kvcompose.config.source import Source, read_file
from kvcompose.spec import TREE_KEY, NodeSpec

#: Names vLLM loads the composite under.
COMPOSITE_NAMES = ("KVCompose", "KVComposeHMA")
EXTRA_CONFIG = "kv_connector_extra_config"

#: ``kv_transfer_params`` keys the P/D connectors vLLM ships put in a finished request.
PD_PARAMS_KEYS = frozenset({
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids",
    "remote_host", "remote_port", "remote_request_id", "tp_size",
})
#: Registered connectors known to produce ``kv_transfer_params``.
PARAMS_PRODUCERS: dict[str, frozenset[str]] = {
    name: PD_PARAMS_KEYS for name in (
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
        "MoRIIOConnector")
}

Translate = Callable[[Path], Path]


def _identity(path: Path) -> Path:
    return path


@dataclass(frozen=True)
class NodeInfo:
    """Where a node sits in the document."""

    name: str
    kind: str
    path: Path  # of the node's body, e.g. ("tree", "chain", "children", 1, "leaf")
    parent: str | None
    index: int | None  # position among the parent's children


@dataclass(frozen=True)
class Config:
    """A loaded config: the tree plus what the CLI needs to explain and print it.

    ``tree`` is the spec handed to the composite: every leaf's ``transfer_config`` already
    holds the document's top-level fields it does not override. ``document`` is the
    normalised user-format document (every node named, overrides applied).
    """

    tree: NodeSpec
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
              check_vllm: bool | None = None) -> NodeSpec:
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
            tree = specs.from_dict(extra[TREE_KEY])
        except Exception as exc:  # internal form: a bug elsewhere if this fails
            raise ConfigError(f"{TREE_KEY}: malformed internal tree "
                              f"({type(exc).__name__}: {exc})", label) from None
        return Config(tree=tree, label=label, origin="internal",
                      nodes={n.name: NodeInfo(n.name, n.kind, (), None, None)
                             for _, n in specs.walk(tree)})
    env = environ(env)
    src, late, _ = _split_extra(dict(extra), env, Source({}, label), ())
    return _load(src, env_overrides(env) + late, check_vllm)


def tree_from_extra_config(extra: Mapping[str, Any], *,
                           env: Mapping[str, str] | None = None,
                           check_vllm: bool | None = None) -> NodeSpec:
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
        from kvcompose.config.render import document_from_tree

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
    compiled = _compile(data, src.label, src.linemap, translate)
    applied: list[str] = []
    for override in overrides:
        document = apply_override(compiled.document, override)
        try:
            compiled = _compile(document, override.source, None, _identity)
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


@dataclass
class _Compiled:
    tree: NodeSpec
    document: dict[str, Any]
    transfer: dict[str, Any]
    hma: bool | None
    version: int
    nodes: dict[str, NodeInfo]
    warnings: list[str]


@dataclass
class _Walked:
    entry: NodeEntry
    path: Path  # of the body
    parent: _Walked | None
    index: int | None
    name: str = ""


def _compile(data: dict[str, Any], label: str | None, linemap: Mapping[Path, int] | None,
             translate: Translate) -> _Compiled:
    def fail(items: list[ErrorItem]) -> ConfigError:
        real = [ErrorItem(translate(i.path), i.message) for i in items]
        return ConfigError([ErrorItem(i.path, i.message, line_for(linemap, i.path))
                            for i in real], label)

    try:
        doc = Document.model_validate(data)
    except ValidationError as exc:
        raise fail(items_from_validation(exc)) from None

    walked: list[_Walked] = []

    def visit(entry: NodeEntry, path: Path, parent: _Walked | None, index: int | None) -> None:
        node = _Walked(entry, (*path, entry.kind), parent, index)
        walked.append(node)
        body = entry.body
        if not isinstance(body, LeafModel):
            for i, child in enumerate(body.children):
                visit(child, (*node.path, "children", i), node, i)

    visit(doc.tree, ("tree",), None, None)
    problems = _assign_names(walked)
    problems += _check_references(walked)
    problems += _check_params(walked)
    if problems:
        raise fail(problems)

    transfer = _top_transfer(doc)
    tree = _build(walked[0], walked, transfer)
    nodes = {w.name: NodeInfo(w.name, w.entry.kind, w.path,
                              w.parent.name if w.parent else None, w.index) for w in walked}
    return _Compiled(tree=tree, document=_dump_document(doc, walked), transfer=transfer,
                     hma=None if doc.hma == "auto" else bool(doc.hma), version=doc.version,
                     nodes=nodes, warnings=_warnings(tree, walked))


def _assign_names(walked: list[_Walked]) -> list[ErrorItem]:
    problems: list[ErrorItem] = []
    taken: dict[str, Path] = {}
    for node in walked:
        name = node.entry.body.name
        if name is None:
            continue
        if name in taken:
            problems.append(ErrorItem((*node.path, "name"), f"duplicate node name {name!r} "
                                      f"(also used at {_fmt(taken[name])})"))
        else:
            taken[name] = (*node.path, "name")
        node.name = name
    for node in walked:
        if node.entry.body.name is not None:
            continue
        body = node.entry.body
        base = body.connector if isinstance(body, LeafModel) else node.entry.kind
        base = "".join(c if c.isalnum() or c in "_-" else "_" for c in base)[:56] or "node"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken[name] = node.path
        node.name = name
    return problems


def _fmt(path: Path) -> str:
    from kvcompose.config.errors import format_path

    return format_path(path)


def _children(node: _Walked, walked: list[_Walked]) -> list[str]:
    return [w.name for w in walked if w.parent is node]


def _check_references(walked: list[_Walked]) -> list[ErrorItem]:
    problems: list[ErrorItem] = []
    for node in walked:
        body = node.entry.body
        kids = _children(node, walked)

        def ref(value: str, path: Path, what: str, kids: list[str] = kids,
                node: _Walked = node) -> None:
            if value not in kids:
                problems.append(ErrorItem(path, f"{what} {value!r} is not a child of "
                                          f"{node.entry.kind} {node.name!r}"
                                          f"{did_you_mean(value, kids)} (children: "
                                          f"{', '.join(kids)})"))

        if isinstance(body, RouteModel):
            ref(body.default, (*node.path, "default"), "default")
            for i, rule in enumerate(body.rules):
                ref(rule.child, (*node.path, "rules", i, "child"), "rule child")
        elif isinstance(body, FanoutModel) and body.load_from is not None:
            ref(body.load_from, (*node.path, "load_from"), "load_from")
    return problems


def _check_params(walked: list[_Walked]) -> list[ErrorItem]:
    producers: list[tuple[_Walked, frozenset[str]]] = []
    for node in walked:
        body = node.entry.body
        if not isinstance(body, LeafModel):
            continue
        if body.params_keys is not None:
            keys = frozenset(body.params_keys)
        elif body.module_path is None:
            keys = PARAMS_PRODUCERS.get(body.connector, frozenset())
        else:
            keys = frozenset()
        if not keys:
            continue
        for other, other_keys in producers:
            common = sorted(keys & other_keys)
            if common:
                shown = ", ".join(common[:4]) + (", ..." if len(common) > 4 else "")
                return [ErrorItem(node.path, f"{node.name!r} ({body.connector}) and "
                                  f"{other.name!r} ({other.entry.body.connector}) would both "
                                  f"produce kv_transfer_params keys ({shown}): at most one "
                                  "leaf may produce each key (set 'params_keys: []' on a leaf "
                                  "that produces none)")]
        producers.append((node, keys))
    return []


def _top_transfer(doc: Document) -> dict[str, Any]:
    out = {key: getattr(doc, key) for key in TRANSFER_FIELDS if getattr(doc, key) is not None}
    out.update(doc.transfer_config)
    return out


def _leaf_transfer(body: LeafModel) -> dict[str, Any]:
    out = {key: getattr(body, key) for key in TRANSFER_FIELDS if getattr(body, key) is not None}
    out.update(body.transfer_config)
    return out


def _build(node: _Walked, walked: list[_Walked], transfer: dict[str, Any]) -> NodeSpec:
    body = node.entry.body
    common = {"name": node.name, "save": body.save, "on_error": body.on_error}
    if isinstance(body, LeafModel):
        return specs.LeafSpec(connector=body.connector, module_path=body.module_path,
                              extra_config=dict(body.extra_config),
                              transfer_config={**transfer, **_leaf_transfer(body)}, **common)
    children = tuple(_build(w, walked, transfer) for w in walked if w.parent is node)
    if isinstance(body, ChainModel):
        return specs.ChainSpec(children=children, policy=body.policy,
                               lookup_timeout_s=float(body.lookup_timeout_s), **common)
    if isinstance(body, FanoutModel):
        return specs.FanoutSpec(children=children, load_from=body.load_from,
                                lookup_timeout_s=float(body.lookup_timeout_s), **common)
    assert isinstance(body, RouteModel)
    rules = tuple(specs.RouteRule(child=r.child, param=r.param, equals=r.equals,
                                  has_equals="equals" in r.model_fields_set,
                                  min_prompt_tokens=r.min_prompt_tokens,
                                  max_prompt_tokens=r.max_prompt_tokens, predicate=r.predicate)
                  for r in body.rules)
    return specs.RouteSpec(children=children, default=body.default, rules=rules,
                           lookup_timeout_s=float(body.lookup_timeout_s), **common)


def _warnings(tree: NodeSpec, walked: list[_Walked]) -> list[str]:
    out: list[str] = []
    if not any(saves for _, saves in effective_saves(tree)):
        out.append("no leaf saves: this tree never stores KV caches")
    for node in walked:
        body = node.entry.body
        if isinstance(body, ChainModel) and len(body.children) == 1:
            out.append(f"{_fmt(node.path)}: chain {node.name!r} has a single child")
    return out


def effective_saves(tree: NodeSpec) -> list[tuple[specs.LeafSpec, bool]]:
    """Every leaf with whether it really saves (its flag and every ancestor's)."""
    out: list[tuple[specs.LeafSpec, bool]] = []

    def visit(node: NodeSpec, parent_saves: bool) -> None:
        saves = parent_saves and node.save
        if isinstance(node, specs.LeafSpec):
            out.append((node, saves))
        else:
            for child in node.children:
                visit(child, saves)

    visit(tree, True)
    return out


# --------------------------------------------------------------------------- dumping

_LEAF_ORDER = ("name", "connector", "module_path", *TRANSFER_FIELDS, "transfer_config",
               "extra_config", "save", "on_error", "params_keys")
_COMPOSITE_ORDER = {
    "chain": ("name", "policy", "lookup_timeout_s", "save", "on_error", "children"),
    "fanout": ("name", "load_from", "lookup_timeout_s", "save", "on_error", "children"),
    "route": ("name", "default", "rules", "lookup_timeout_s", "save", "on_error",
              "children"),
}
_RULE_ORDER = ("param", "equals", "min_prompt_tokens", "max_prompt_tokens", "predicate",
               "child")


def _dump_document(doc: Document, walked: list[_Walked]) -> dict[str, Any]:
    out: dict[str, Any] = {"version": doc.version}
    for key in (*TRANSFER_FIELDS, "transfer_config", "hma", "strict"):
        if key in doc.model_fields_set:
            out[key] = _plain(getattr(doc, key))
    out["tree"] = _dump_node(walked[0], walked)
    return out


def _dump_node(node: _Walked, walked: list[_Walked]) -> dict[str, Any]:
    body = node.entry.body
    kind = node.entry.kind
    order = _LEAF_ORDER if kind == "leaf" else _COMPOSITE_ORDER[kind]
    out: dict[str, Any] = {}
    for key in order:
        if key == "name":
            out["name"] = node.name
        elif key == "children":
            out["children"] = [_dump_node(w, walked) for w in walked if w.parent is node]
        elif key == "rules":
            if "rules" in body.model_fields_set:
                out["rules"] = [{k: _plain(getattr(r, k)) for k in _RULE_ORDER
                                 if k in r.model_fields_set} for r in body.rules]
        elif key in body.model_fields_set:
            out[key] = _plain(getattr(body, key))
    return {kind: out}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
