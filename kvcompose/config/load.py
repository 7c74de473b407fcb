"""From user input (files, dicts, ``kv_connector_extra_config``) to a validated tree.

Every input becomes one kvcompose document, compiled in one place (``_load``). ``shape_of``
tells the input's shape from its keys, and ``FORMS`` says for each shape how it becomes a
document and where the document's paths are in the input (a ``PathMap``). Two shapes carry
a document rather than being one, inline or in a file: a KVCompose ``--kv-transfer-config``
and a ``kv_connector_extra_config``; the document they carry is read like any other.
Overrides (the environment's, then the extra config's keys, then the caller's) address
nodes by name, so they apply to the compiled document (every node named), which is then
validated once more, after all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from kvcompose.config.compile import Compiled, NodeInfo, check_tree, compile_document
from kvcompose.config.config import Config
from kvcompose.config.document_form import document_from_tree
from kvcompose.config.env import (
    Override,
    apply_override,
    env_overrides,
    environ,
)
from kvcompose.config.errors import ConfigError, ErrorItem, Path, line_for
from kvcompose.config.extra_config import EXTRA_CONFIG, opened, split_extra
from kvcompose.config.files import Source, gc_paused
from kvcompose.config.include import including
from kvcompose.config.messages import items_from_validation
from kvcompose.config.paths import SAME, PathMap
from kvcompose.config.walk import check_plain
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
from kvcompose.tree.error_messages import format_path, shown

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


class Shape(enum.Enum):
    """The shapes of input kvcompose reads, told from their keys (``shape_of``)."""

    DOCUMENT = "document"  # {"tree": ..., top-level fields}
    BARE_NODE = "bare node"  # {"chain": {...}}: a tree without its document
    MULTICONNECTOR = "multiconnector"  # MultiConnector's --kv-transfer-config, or its extra
    KVCOMPOSE_ARGS = "kvcompose-args"  # KVCompose's --kv-transfer-config (vllm-args prints it)
    CONNECTOR = "connector"  # another connector's --kv-transfer-config: refused


def shape_of(data: Mapping[str, Any], *, top: bool) -> Shape:
    """The shape of ``data``; ``top``: it is the input itself, not a document a KVCompose
    ``--kv-transfer-config`` or an extra config carries (those hold no further one)."""
    connector = data.get("kv_connector")
    if top and isinstance(connector, str) and connector in COMPOSITE_NAMES:
        return Shape.KVCOMPOSE_ARGS
    if data and set(data) <= set(NODE_KINDS):
        return Shape.BARE_NODE
    if ("connectors" in data and "tree" not in data) or connector == "MultiConnector":
        return Shape.MULTICONNECTOR
    if "kv_connector" in data and "tree" not in data:
        return Shape.CONNECTOR
    return Shape.DOCUMENT


#: A shape's document and path map, from the input's data, its source and the path map
#: that places the data in the source.
ToDocument = Callable[[dict[str, Any], Source, PathMap], tuple[dict[str, Any], PathMap]]


@dataclasses.dataclass(frozen=True)
class Form:
    """How inputs of one shape become a kvcompose document."""

    document: ToDocument
    origin: str | None = None  # ``Config.origin``; None: that of what carries the document


def _as_is(data: dict[str, Any], src: Source, paths: PathMap) -> tuple[dict[str, Any], PathMap]:
    return data, paths


def _bare_node(data: dict[str, Any], src: Source, paths: PathMap) -> tuple[dict[str, Any], PathMap]:
    return {"tree": data}, dataclasses.replace(paths, bare=True)


def _multiconnector(
    data: dict[str, Any], src: Source, paths: PathMap
) -> tuple[dict[str, Any], PathMap]:
    from kvcompose.config.multiconnector import document_from_multiconnector

    return document_from_multiconnector(data, paths, src)


def _refused(data: dict[str, Any], src: Source, paths: PathMap) -> tuple[dict[str, Any], PathMap]:
    name = data["kv_connector"]
    why = (
        "is the kvcompose connector itself: name a kvcompose document here, not a "
        "--kv-transfer-config"
        if name in COMPOSITE_NAMES
        else "is a single connector: kvcompose reads its own documents, KVCompose and "
        "MultiConnector configs"
    )
    raise src.error(paths(("kv_connector",)), f"{shown(name)} {why}")


#: Each shape that is a document itself (``KVCOMPOSE_ARGS`` carries one: ``_from_args``).
FORMS: dict[Shape, Form] = {
    Shape.DOCUMENT: Form(_as_is),
    Shape.BARE_NODE: Form(_bare_node),
    Shape.MULTICONNECTOR: Form(_multiconnector, "multiconnector"),
    Shape.CONNECTOR: Form(_refused),
}


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
    with gc_paused(), _read(source) as src:
        config = _load(src, env, list(overrides or []), check_vllm, top=True)
        connector = src.data.get("kv_connector")  # a mapping: it loaded
        if isinstance(connector, str):
            module = src.data.get("kv_connector_module_path")
            loaded_as = (connector, module if isinstance(module, str) else None)
            config = dataclasses.replace(config, loaded_as=loaded_as)
        return config


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


@contextlib.contextmanager
def _read(source: str | os.PathLike | Mapping[str, Any]) -> Iterator[Source]:
    """The input, parsed (told by its Python type: this is reading, not its shape)."""
    if isinstance(source, Source):  # already parsed (e.g. standard input)
        yield source
    elif isinstance(source, Mapping):
        check_plain(source, None)
        yield Source(dict(source))
    elif isinstance(source, (str, os.PathLike)):
        with including(os.fspath(source)) as src:
            yield src
    else:
        raise ConfigError(f"expected a file path or a mapping, got {describe(source)}")


def _load(
    src: Source,
    env: Mapping[str, str],
    late: list[Override],
    check_vllm: bool | None,
    *,
    top: bool = False,
    paths: PathMap = SAME,
    origin: str = "document",
) -> Config:
    """The config of the document in ``src`` (``paths`` places it there); ``late``: the
    overrides that apply after the environment's."""
    data = src.mapping()
    shape = shape_of(data, top=top)
    if shape is Shape.KVCOMPOSE_ARGS:
        return _from_args(data, src, env, late, check_vllm)
    form = FORMS[shape]
    document, paths = form.document(data, src, paths)
    compiled = compile_document(document, src.label, src.linemap, paths)
    overrides = env_overrides(env) + late
    if overrides:
        compiled = _overridden(compiled, overrides)
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
        overrides=tuple(o.source for o in overrides),
        origin=form.origin or origin,
        linemap=src.linemap,
        translate=paths,
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


def _overridden(compiled: Compiled, overrides: list[Override]) -> Compiled:
    """The compiled document with every override applied, validated once."""
    document = compiled.document
    try:
        for override in overrides:
            check_plain(override.value, override.source)
            document = apply_override(document, override)
        return compile_document(document, None, None, SAME)
    except ConfigError:
        raise _at_fault(compiled.document, overrides) from None


def _at_fault(document: dict[str, Any], overrides: list[Override]) -> ConfigError:
    """Why the overrides fail, named after the first at fault: the first that cannot be
    applied, or after which the document does not validate (a cold path: each override
    is applied and validated in turn, to say which one broke the document)."""
    for override in overrides:
        check_plain(override.value, override.source)
        document = apply_override(document, override)
        try:
            compile_document(document, override.source, None, SAME)
        except ConfigError as exc:
            return ConfigError(exc.items, override.source)
    raise AssertionError("overrides that fail together fail one at a time")


def _from_args(
    data: dict[str, Any],
    src: Source,
    env: Mapping[str, str],
    late: list[Override],
    check_vllm: bool | None,
) -> Config:
    """A KVCompose ``--kv-transfer-config`` (what ``vllm-args`` prints): the document its
    extra config carries, with its own ``KVTransferConfig`` fields at the top."""
    extra = data.get(EXTRA_CONFIG)
    if not isinstance(extra, Mapping):
        raise src.error((EXTRA_CONFIG,), f"expected a mapping, got {describe(extra)}")
    parent = {k: v for k, v in data.items() if k in TRANSFER_FIELDS and v is not None}
    if TREE_KEY in extra:  # the internal form, in a file: validate it like any document
        tree = _parse_internal(extra[TREE_KEY], src.label, (EXTRA_CONFIG, TREE_KEY))
        doc = document_from_tree(tree, parent)
        if extra.get("strict"):
            doc["strict"] = True
        internal = Source(doc, src.label, None, src.path)  # type: ignore[arg-type]
        return _load(internal, env, late, check_vllm, origin="internal")
    found = split_extra(dict(extra), env, src, (EXTRA_CONFIG,))
    with opened(found) as inner:
        merged = Source({**parent, **inner.mapping()}, inner.label, inner.linemap, inner.path)
        if found.inline is None:
            return _load(merged, env, found.overrides + late, check_vllm)
        paths = PathMap((EXTRA_CONFIG,), frozenset(parent) - frozenset(inner.data))
        return _load(
            merged, env, found.overrides + late, check_vllm, paths=paths, origin="kvcompose-args"
        )


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
        # an inline document's lines are those of ``outer``, a file's its own
        paths = PathMap(prefix if found.inline is not None else ())
        return _load(src, env, found.overrides, check_vllm, paths=paths)


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
