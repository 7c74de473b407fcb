"""Checks and facts that need vLLM: connector names, classes, HMA, layouts, cudagraphs.

Imported only when vLLM is installed and the checks are wanted; everything here imports
vLLM lazily, inside the functions.

The checks import the user's connector and predicate modules and call connector class
methods: that code runs with ``sys.stdout`` sent to ``sys.stderr`` (so ``vllm-args --json``
stays one clean line), and a ``sys.exit()`` in it becomes a ``ConfigError`` at the leaf,
instead of ending the CLI (or vLLM's engine process) without a word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

from pydantic import ValidationError

from kvcompose.config.deadline import UserCodeTimeout, limit_s, time_limit
from kvcompose.config.known import needs_package, no_hma
from kvcompose.tree import Leaf, Route, child_transfer_config, effective_saves, walk
from kvcompose.tree.error_messages import Wording, at, did_you_mean, shown
from kvcompose.tree.saves_off import SaveFalseRefused

#: Connectors vLLM special-cases by name (``KVTransferConfig.has_connector``, HiSparse,
#: SimpleCPUOffload); under a KVCompose composite those checks do not see them.
NAME_CHECKED = (
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "MoRIIOConnector",
    "MooncakeConnector",
    "HiSparseConnector",
    "SimpleCPUOffloadConnector",
)


@dataclass
class LeafFacts:
    name: str
    connector: str
    class_name: str = "?"
    supports_hma: bool | None = None
    piecewise: bool | None = None
    layout: str | None = None  # required KV cache layout, "" when the model decides
    layout_scope: str = ""  # e.g. "non-MLA models" when the answer depends on the model
    note: str | None = None


@dataclass
class VllmFacts:
    """What vLLM will see for a config."""

    leaves: dict[str, LeafFacts] = field(default_factory=dict)
    registry: tuple[str, ...] = ()
    missing_packages: dict[str, str] = field(default_factory=dict)  # leaf -> package

    @property
    def all_hma(self) -> bool:
        return bool(self.leaves) and all(f.supports_hma for f in self.leaves.values())

    @property
    def piecewise(self) -> list[str]:
        return [f.name for f in self.leaves.values() if f.piecewise]

    @property
    def layouts(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for f in self.leaves.values():
            if f.layout:
                out.setdefault(f.layout, []).append(f.name)
        return out

    def warnings(self) -> list[str]:
        out = [
            f"leaf {leaf!r} needs the {package!r} package, which this Python cannot import; "
            "vLLM will fail to start it here"
            for leaf, package in self.missing_packages.items()
        ]
        layouts = self.layouts
        if len(layouts) <= 1:
            return out
        listed = "; ".join(f"{layout} ({', '.join(names)})" for layout, names in layouts.items())
        return [
            *out,
            f"leaves require different KV cache layouts: {listed}; the composite refuses "
            "to start where these apply",
        ]


def registry() -> dict[str, Any]:
    """vLLM's connector registry, with kvcompose's own names registered."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.plugin import register

    register()
    return KVConnectorFactory._registry


def inspect_config(config: Any) -> VllmFacts:
    """Check a loaded ``Config`` against vLLM and collect what vLLM will see.

    Raises ``ConfigError`` (with the path of the leaf) for unknown connector names, modules
    that do not import, missing classes, old constructor signatures, ``transfer_config``
    keys vLLM does not know, child configs vLLM rejects, leaves that cannot meet
    ``hma: true``, and route predicates that do not import.
    """
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.utils.func_utils import supports_kw

    try:
        seconds = limit_s()
    except ValueError as exc:
        raise config.error((), str(exc)) from None
    reg = registry()
    facts = VllmFacts(registry=tuple(sorted(reg)))
    ktc_fields = {f.name for f in dataclasses.fields(KVTransferConfig)}
    paths = config.leaf_paths()
    saves = {leaf.name: s for leaf, s in effective_saves(config.tree)}
    for _, node in walk(config.tree):
        if isinstance(node, Route):
            info = config.nodes.get(node.name)
            where = info.path if info else ()
            with _user_code(config, where, f"route {shown(node.name)}", seconds):
                _check_predicates(config, node, where)
        if not isinstance(node, Leaf):
            continue
        path = paths.get(node.name, ())
        with _user_code(config, path, f"connector {shown(node.connector)}", seconds):
            _check_leaf(config, node, path, reg, supports_kw, ktc_fields, facts, saves[node.name])
    return facts


def _check_leaf(
    config: Any,
    node: Leaf,
    path: tuple,
    reg: dict[str, Any],
    supports_kw: Any,
    ktc_fields: set[str],
    facts: VllmFacts,
    saves: bool,
) -> None:
    """One leaf's checks and facts (``saves``: whether it really saves)."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    cls = _resolve(config, node, path, reg, supports_kw)
    for key in node.transfer_config:
        if key not in ktc_fields:
            raise config.error(
                (*path, "transfer_config", key),
                f"{shown(key)} is not a KVTransferConfig field in this vLLM"
                f"{did_you_mean(key, ktc_fields)}",
            )
    try:
        kwargs = child_transfer_config({}, node, saves=saves)
    except SaveFalseRefused as exc:
        raise config.error((*path, "save"), str(exc)) from None
    kwargs.setdefault("kv_role", "kv_both")  # the composite's own role fills it in
    try:
        ktc = KVTransferConfig(**kwargs)
    except Exception as exc:
        raise config.error(
            path, f"vLLM rejects this child's KVTransferConfig: {_one_line(exc)}"
        ) from None
    info = LeafFacts(node.name, node.connector, getattr(cls, "__name__", "?"))
    info.supports_hma = bool(supports_hma(cls))
    try:
        info.piecewise = bool(cls.requires_piecewise_for_cudagraph(dict(node.extra_config)))
    except Exception as exc:
        info.note = f"requires_piecewise_for_cudagraph failed: {_one_line(exc)}"
    info.layout, info.layout_scope = _layout(cls, ktc)
    if config.hma is True and not info.supports_hma:
        raise config.error((*path, "connector"), no_hma(node.connector))
    facts.leaves[node.name] = info
    package = needs_package(node)
    if package is not None and importlib.util.find_spec(package) is None:
        facts.missing_packages[node.name] = package


@contextlib.contextmanager
def _user_code(config: Any, where: tuple, what: str, seconds: float) -> Iterator[None]:
    """Run code from connector or predicate modules: its prints go to stderr, and a
    ``sys.exit()`` or a run past ``seconds`` (:mod:`kvcompose.config.deadline`) becomes a
    ``ConfigError`` at ``where``."""
    try:
        with contextlib.redirect_stdout(sys.stderr), time_limit(seconds, f"checking {what}"):
            yield
    except SystemExit as exc:
        raise config.error(
            where, f"{what}: its code called sys.exit({exc.code!r}) while being checked"
        ) from None
    except UserCodeTimeout as exc:  # the timer fired outside an import
        raise config.error(
            where, f"{what}: its checks did not finish within {exc.seconds:g} s ({_MORE_TIME})"
        ) from None


#: How to allow the checks more time, for the messages (not the CLI's ``--offline``: the
#: same checks run inside vLLM, which has no such flag).
_MORE_TIME = "KVCOMPOSE_CHECK_TIMEOUT=SECONDS allows longer"


def _import(config: Any, where: tuple, name: str) -> ModuleType:
    """``name`` imported (inside ``_user_code``: its prints already go to stderr)."""
    try:
        return importlib.import_module(name)
    except SystemExit as exc:
        raise config.error(
            where,
            f"cannot import module {shown(name)}: it calls sys.exit({exc.code!r}) on import",
        ) from None
    except UserCodeTimeout as exc:
        raise config.error(
            where,
            f"importing module {shown(name)} did not finish within {exc.seconds:g} s "
            f"({_MORE_TIME})",
        ) from None
    except Exception as exc:
        raise config.error(
            where, f"cannot import module {shown(name)} ({_one_line(exc)})"
        ) from None


def _connector_class(config: Any, where: tuple, cls: Any, what: str) -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if not isinstance(cls, type):
        raise config.error(where, f"{what} is not a class")
    if not issubclass(cls, KVConnectorBase_V1):
        raise config.error(
            where, f"{what} is not a vLLM KV connector (not a subclass of KVConnectorBase_V1)"
        )
    return cls


def _resolve(config: Any, leaf: Leaf, path: tuple, reg: dict[str, Any], supports_kw: Any) -> type:
    if leaf.module_path:
        module = _import(config, (*path, "module_path"), leaf.module_path)
        cls = getattr(module, leaf.connector, None)
        if cls is None:
            names = [n for n in dir(module) if n.endswith("Connector") or n[:1].isupper()]
            raise config.error(
                (*path, "connector"),
                f"module {shown(leaf.module_path)} has no "
                f"class {shown(leaf.connector)}"
                f"{did_you_mean(leaf.connector, names)}",
            )
        cls = _connector_class(
            config, (*path, "connector"), cls, f"{leaf.module_path}.{leaf.connector}"
        )
        if not supports_kw(cls, "kv_cache_config"):
            raise config.error(
                (*path, "connector"),
                f"{leaf.connector!r} uses the old "
                "2-argument constructor: vLLM needs (vllm_config, role, "
                "kv_cache_config)",
            )
        return cls
    if leaf.connector not in reg:
        known = sorted(reg)
        raise config.error(
            (*path, "connector"),
            f"unknown connector {shown(leaf.connector)}"
            f"{did_you_mean(leaf.connector, known)}; known: {', '.join(known)} "
            "(or set module_path)",
        )
    try:
        cls = reg[leaf.connector]()
    except Exception as exc:
        raise config.error(
            (*path, "connector"),
            f"connector {leaf.connector!r} cannot be imported ({_one_line(exc)})",
        ) from None
    return _connector_class(config, (*path, "connector"), cls, f"connector {leaf.connector!r}")


def _check_predicates(config: Any, route: Route, base: tuple) -> None:
    for index, rule in enumerate(route.rules):
        if not rule.predicate:
            continue
        where = (*base, "rules", index, "predicate")
        module_name, _, attr = rule.predicate.partition(":")
        obj: Any = _import(config, where, module_name)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise config.error(where, f"{shown(module_name)} has no attribute {shown(attr)}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise config.error(where, f"{shown(rule.predicate)} is not callable")


def _layout(cls: type, ktc: Any) -> tuple[str | None, str]:
    """The KV cache layout a connector class requires, asked without a real model: once with
    no model config and once with a non-MLA one (NIXL and Mooncake only ask for a layout
    for non-MLA models). ``""`` when the answer needs the real model."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # connectors log about the missing model config
    answers: list[str | Exception | None] = []
    try:
        for model_config in (None, SimpleNamespace(use_mla=False)):
            probe = SimpleNamespace(model_config=model_config, kv_transfer_config=ktc)
            try:
                answers.append(cls.get_required_kvcache_layout(probe))
            except Exception as exc:
                answers.append(exc)
    finally:
        logging.disable(previous)
    without, non_mla = answers
    if isinstance(non_mla, Exception):
        return ("", "") if isinstance(without, Exception) or without is None else (without, "")
    if isinstance(without, Exception) or without != non_mla:
        return non_mla, "non-MLA models" if non_mla else ""
    return non_mla, ""


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):  # vLLM's pydantic configs, worded as ours are
        return at(*Wording(None).problems(exc)[0]).splitlines()[0]  # vLLM's first line says it
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
