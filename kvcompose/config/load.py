"""From user input (files, dicts, ``kv_connector_extra_config``) to a validated tree."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from kvcompose.config.compile import NodeInfo, Translate, check_tree, compile_document
from kvcompose.config.document import document_from_tree
from kvcompose.config.env import (
    Override,
    apply_override,
    env_overrides,
    environ,
)
from kvcompose.config.errors import ConfigError, ErrorItem, Path, line_for
from kvcompose.config.extra_config import EXTRA_CONFIG, opened, split_extra
from kvcompose.config.include import including
from kvcompose.config.loaded import Config, identity
from kvcompose.config.messages import items_from_validation
from kvcompose.config.plain import check_plain
from kvcompose.config.source import Source, gc_paused
from kvcompose.tree import (
    NODE_KINDS,
    TRANSFER_FIELDS,
    TREE_KEY,
    Leaf,
    Node,
    describe,
    parse_node,
    walk,
)
from kvcompose.tree.messages import format_path, shown

#: Names vLLM loads the composite under.
COMPOSITE_NAMES = ("KVCompose", "KVComposeHMA")
#: Leaves whose connector is a kvcompose composite, with a tree of its own in
#: ``extra_config``: (connector, module_path).
NESTED_COMPOSITES = frozenset(
    {
        (name, module)
        for name in COMPOSITE_NAMES
        for module in (None, "kvcompose", "kvcompose.connector")
    }
    | {("MultiConnector", "kvcompose.compat")}
)


# --------------------------------------------------------------------------- public API


def load_config(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    overrides: list[Override] | None = None,
    check_vllm: bool | None = None,
) -> Config:
    """Load and validate a config from a YAML/JSON file or a dict in the user format.

    Also accepted: a bare node (``{"chain": {...}}``), vLLM MultiConnector JSON (the whole
    ``--kv-transfer-config`` or just its ``{"connectors": [...]}``) and the KVCompose
    ``--kv-transfer-config`` that ``kvcompose vllm-args`` prints. ``env`` defaults to
    ``os.environ`` (pass ``{}`` to ignore it); ``overrides`` apply after the environment.
    ``check_vllm``: run the checks that import vLLM (default: when vLLM is installed).
    """
    env = environ(env)
    with gc_paused():
        if isinstance(source, Source):  # already parsed (e.g. standard input)
            return _load_source(source, env, overrides or [], check_vllm)
        if isinstance(source, Mapping):
            check_plain(source, None)
            return _load_source(Source(dict(source)), env, overrides or [], check_vllm)
        if isinstance(source, (str, os.PathLike)):
            with including(os.fspath(source)) as src:
                return _load_source(src, env, overrides or [], check_vllm)
    raise ConfigError(f"expected a file path or a mapping, got {describe(source)}")


def load_tree(
    source: str | os.PathLike | Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    check_vllm: bool | None = None,
) -> Node:
    """The validated tree of a config file (YAML/JSON) or dict; raises ``ConfigError``."""
    return load_config(source, env=env, check_vllm=check_vllm).tree


def config_from_extra_config(
    extra: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    check_vllm: bool | None = None,
) -> Config:
    """Load the tree a KVCompose connector was given in its ``kv_connector_extra_config``.

    Forms: ``{TREE_KEY: <canonical dict>}`` (internal, already validated);
    ``{"config": "tree.yaml", ...overrides}``; an inline document ``{"tree": {...}, ...}``;
    vLLM MultiConnector's ``{"connectors": [...]}``. With none of these,
    ``KVCOMPOSE_CONFIG_FILE`` names the file. Every form but the first takes a ``set``
    mapping of ``node.key`` overrides and honours the environment.

    Whatever ``extra`` holds, the result is a ``Config`` or a ``ConfigError``: the same
    bounds and checks as for files apply (see ``kvcompose.config.limits``).
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"expected a mapping, got {describe(extra)}", EXTRA_CONFIG)
    extra = dict(extra)
    if isinstance(extra.get("config"), os.PathLike):
        extra["config"] = os.fspath(extra["config"])
    with gc_paused():
        check_plain(extra, EXTRA_CONFIG)
        return _from_extra(extra, environ(env), check_vllm, Source({}, EXTRA_CONFIG), ())


def tree_from_extra_config(
    extra: Mapping[str, Any],
    *,
    env: Mapping[str, str] | None = None,
    check_vllm: bool | None = None,
) -> Node:
    """The tree for a KVCompose connector's ``kv_connector_extra_config`` (see
    ``config_from_extra_config`` for the accepted forms)."""
    return config_from_extra_config(extra, env=env, check_vllm=check_vllm).tree


def vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- pipeline


def _from_extra(
    extra: dict[str, Any],
    env: Mapping[str, str],
    check_vllm: bool | None,
    outer: Source,
    prefix: Path,
) -> Config:
    """An extra config's tree; ``prefix`` is where ``extra`` sits in ``outer`` (a nested
    KVCompose leaf's ``extra_config``), ``()`` for vLLM's own."""
    if TREE_KEY in extra:
        return _internal(extra[TREE_KEY], outer.label, (*prefix, TREE_KEY))
    found = split_extra(extra, env, outer, prefix)
    with opened(found) as src:
        translate = identity
        if found.inline is not None and prefix:

            def translate(path: Path) -> Path:
                return (*prefix, *path)

        return _load(
            src, env_overrides(env) + found.overrides, check_vllm, env=env, translate=translate
        )


def _parse_internal(data: Any, label: str | None, where: Path) -> Node:
    try:
        return parse_node(data)
    except ValidationError as exc:
        raise _malformed(items_from_validation(exc)[0], label, where) from None


def _malformed(problem: ErrorItem, label: str | None, where: Path) -> ConfigError:
    return ConfigError(ErrorItem(where, f"malformed internal tree: {problem.render()}"), label)


def _internal(data: Any, label: str | None, where: Path) -> Config:
    """The canonical subtree a composite hands a nested one: checked, never changed."""
    tree = _parse_internal(data, label, where)
    problems = check_tree(tree)
    if problems:
        raise _malformed(problems[0], label, where)
    return Config(
        tree=tree,
        label=label,
        origin="internal",
        nodes={
            n.name: NodeInfo(n.name, n.kind, (), None, None)  # type: ignore[arg-type]
            for _, n in walk(tree)
        },
    )


def _load_source(
    src: Source, env: Mapping[str, str], overrides: list[Override], check_vllm: bool | None
) -> Config:
    data = src.mapping()
    if isinstance(data.get("kv_connector"), str) and data["kv_connector"] in COMPOSITE_NAMES:
        config = _from_composite_args(data, src, env, overrides, check_vllm)
    else:
        config = _load(src, env_overrides(env) + overrides, check_vllm, env=env)
    if isinstance(data.get("kv_connector"), str):
        module = data.get("kv_connector_module_path")
        config = dataclasses.replace(
            config, loaded_as=(data["kv_connector"], module if isinstance(module, str) else None)
        )
    return config


def _from_composite_args(
    data: dict[str, Any],
    src: Source,
    env: Mapping[str, str],
    overrides: list[Override],
    check_vllm: bool | None,
) -> Config:
    """A KVCompose ``--kv-transfer-config`` (what ``vllm-args`` prints)."""
    extra = data.get(EXTRA_CONFIG)
    if not isinstance(extra, Mapping):
        raise src.error((EXTRA_CONFIG,), f"expected a mapping, got {describe(extra)}")
    parent = {k: v for k, v in data.items() if k in TRANSFER_FIELDS and v is not None}
    if TREE_KEY in extra:  # the internal form, in a file: validate it like any document
        tree = _parse_internal(extra[TREE_KEY], src.label, (EXTRA_CONFIG, TREE_KEY))
        doc = document_from_tree(tree, parent)
        if extra.get("strict"):
            doc["strict"] = True
        return _load(
            Source(doc, src.label, None, src.path),
            env_overrides(env) + list(overrides),
            check_vllm,
            env=env,
            origin="internal",
        )
    found = split_extra(dict(extra), env, src, (EXTRA_CONFIG,))
    everything = env_overrides(env) + found.overrides + list(overrides)
    with opened(found) as inner:
        merged = Source({**parent, **inner.mapping()}, inner.label, inner.linemap, inner.path)
        if found.inline is None:
            return _load(merged, everything, check_vllm, env=env)

        def translate(path: Path) -> Path:
            if path and path[0] in parent and path[0] not in inner.data:
                return path
            return (EXTRA_CONFIG, *path)

        return _load(
            merged, everything, check_vllm, env=env, translate=translate, origin="kvcompose-args"
        )


def _load(
    src: Source,
    overrides: list[Override],
    check_vllm: bool | None,
    *,
    env: Mapping[str, str],
    translate: Translate = identity,
    origin: str = "document",
) -> Config:
    data = src.mapping()
    if data and set(data) <= set(NODE_KINDS):
        data = {"tree": data}  # a bare node
        inner = translate

        def translate(path: Path, inner: Translate = inner) -> Path:
            return inner(path[1:] if path[:1] == ("tree",) else path)
    elif ("connectors" in data and "tree" not in data) or data.get(
        "kv_connector"
    ) == "MultiConnector":
        from kvcompose.config.multiconnector import document_from_multiconnector

        data, translate = document_from_multiconnector(data, translate, src)
        origin = "multiconnector"
    elif "kv_connector" in data and "tree" not in data:
        name = data["kv_connector"]
        why = (
            "is the kvcompose connector itself: name a kvcompose document here, not a "
            "--kv-transfer-config"
            if name in COMPOSITE_NAMES
            else "is a single connector: kvcompose reads its own documents, KVCompose and "
            "MultiConnector configs"
        )
        raise src.error(translate(("kv_connector",)), f"{shown(name)} {why}")
    compiled = compile_document(data, src.label, src.linemap, translate)
    applied: list[str] = []
    for override in overrides:
        check_plain(override.value, override.source)
        document = apply_override(compiled.document, override)
        try:
            compiled = compile_document(document, override.source, None, identity)
        except ConfigError as exc:
            raise ConfigError(exc.items, override.source) from None
        applied.append(override.source)
    config = Config(
        tree=compiled.tree,
        document=compiled.document,
        transfer=compiled.transfer,
        hma=compiled.hma,
        version=compiled.version,
        label=src.label,
        path=src.path,
        nodes=compiled.nodes,
        warnings=tuple(compiled.warnings),
        overrides=tuple(applied),
        origin=origin,
        linemap=src.linemap,
        translate=translate,
    )
    _check_nested(config, env, check_vllm)
    if check_vllm is None:
        check_vllm = vllm_available()
    if check_vllm:
        from kvcompose.config.vllm_checks import inspect_config

        facts = inspect_config(config)
        config = dataclasses.replace(
            config, facts=facts, warnings=config.warnings + tuple(facts.warnings())
        )
    return config


def _check_nested(config: Config, env: Mapping[str, str], check_vllm: bool | None) -> None:
    """Load the tree of every leaf that is itself a kvcompose composite, as vLLM will when
    it builds that leaf: a missing or broken nested tree, or a file that includes itself,
    is refused now rather than in vLLM's engine."""
    for _, node in walk(config.tree):
        if (
            not isinstance(node, Leaf)
            or (node.connector, node.module_path) not in NESTED_COMPOSITES
        ):
            continue
        info = config.nodes.get(node.name)
        where = config.translate((*(info.path if info else ()), "extra_config"))
        outer = Source(None, config.label, config.linemap or None, config.path)  # type: ignore[arg-type]
        try:
            _from_extra(dict(node.extra_config), env, check_vllm, outer, where)
        except ConfigError as exc:
            if exc.label == config.label:
                raise
            line = line_for(config.linemap, where)
            at = f"{config.label}:{line}" if line else str(config.label)
            raise ConfigError(
                [
                    ErrorItem(
                        i.path,
                        f"{i.message} (in the tree of {at}: {format_path(where[:-1])})",
                        i.line,
                    )
                    for i in exc.items
                ],
                exc.label,
            ) from None
