"""Building a composite's children as real vLLM connectors, and calling them.

A leaf becomes whatever connector class vLLM's factory resolves for it. A nested composite
becomes another ``KVCompose`` instance, loaded through the same factory with its subtree in
``kv_connector_extra_config`` — nesting needs no special code because a composite *is* a
connector.

Each child gets its own shallow copy of the ``VllmConfig`` with its own ``KVTransferConfig``
(``kvcompose.composite.child_configs``: the parent's fields it does not set are inherited; upstream
MultiConnector inherits none, and crashes when a child sets its own ``engine_id``).

``Children`` is what both halves of a node hold: the built children, the node's guard, and
the three ways a node calls them when no per-request logic is involved.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

from kvcompose import tree as nodes
from kvcompose.composite.child_configs import child_transfer_dict

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvcompose.composite.guard import Guard

T = TypeVar("T")


class ChildConfigError(ValueError):
    """A child's connector cannot be built from its config."""


@dataclass
class Child:
    """One child of a composite node, as the node sees it."""

    name: str
    spec: nodes.Node
    connector: KVConnectorBase_V1
    saves: bool


class Children(Sequence[Child]):
    """The children of one node, in order, with the node's guard.

    Errors: ``all`` lets a child's exception through (set-up and bookkeeping calls a child
    cannot work without); ``call`` and ``any`` contain it by the child's ``on_error`` policy.
    """

    def __init__(self, children: list[Child], guard: Guard) -> None:
        self._children = children
        self.guard = guard
        self.connectors = [c.connector for c in children]
        self.names = [c.name for c in children]
        self._implementing: dict[str, tuple[int, ...]] = {}

    @overload
    def __getitem__(self, index: int) -> Child: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Child]: ...
    def __getitem__(self, index: int | slice) -> Child | Sequence[Child]:
        return self._children[index]

    def __len__(self) -> int:
        return len(self._children)

    def __iter__(self) -> Iterator[Child]:
        return iter(self._children)

    def implementing(self, method: str) -> tuple[int, ...]:
        """The children whose ``method`` is their own, not ``KVConnectorBase_V1``'s inherited
        unchanged. Where the base method does nothing and returns what the node's
        aggregation ignores (``None``, ``False``, ``()``, ``(False, None)``), the node calls
        only these: the others' answer is known. Decided once per method; ``refresh`` after
        replacing a method on a child instance."""
        found = self._implementing.get(method)
        if found is None:
            found = self._implementing[method] = tuple(
                i for i, c in enumerate(self.connectors) if not inherits_base(c, method)
            )
        return found

    def refresh(self) -> None:
        """Forget which children implement which methods (see ``implementing``)."""
        self._implementing.clear()

    def all(self, method: str, *args: Any, **kwargs: Any) -> None:
        for child in self.connectors:
            getattr(child, method)(*args, **kwargs)

    def call(self, child: int, method: str, default: T, *args: Any, **kwargs: Any) -> T:
        try:
            return getattr(self.connectors[child], method)(*args, **kwargs)
        except Exception as exc:
            self.guard.child_error(child, method, exc)  # re-raises under on_error: fail
            return default

    def any(self, method: str) -> bool:
        """Whether any child answers true (a method whose base answer is ``False``)."""
        call = self.call
        return any(call(i, method, False) for i in self.implementing(method))


def inherits_base(connector: KVConnectorBase_V1, method: str) -> bool:
    """Whether ``connector.method`` is ``KVConnectorBase_V1``'s own function, unchanged (not
    overridden by its class, nor replaced on the instance)."""
    bound = getattr(connector, method)
    return getattr(bound, "__func__", None) is getattr(KVConnectorBase_V1, method)


def child_vllm_config(
    vllm_config: VllmConfig,
    node: nodes.Node,
    *,
    strict: bool,
    hma: bool,
    parent_saves: bool = True,
) -> VllmConfig:
    assert vllm_config.kv_transfer_config is not None
    try:
        fields = child_transfer_dict(
            vllm_config.kv_transfer_config, node, strict=strict, hma=hma, parent_saves=parent_saves
        )
        if not (parent_saves and node.save):
            check_store_threshold(fields)
        child_ktc = KVTransferConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ChildConfigError(f"node {node.name!r}: invalid KVTransferConfig: {exc}") from exc
    config = copy.copy(vllm_config)
    config.kv_transfer_config = child_ktc
    return config


def check_store_threshold(fields: dict[str, Any]) -> None:
    """A non-saving ``OffloadingConnector`` is kept from storing by ``store_threshold``
    (``kvcompose.tree.saves_off``), which ``CPUOffloadingSpec.get_manager`` reads: refuse an
    out-of-tree spec (``spec_module_path``) that builds its manager another way
    (``TieringOffloadingSpec``, built on ``CPUOffloadingSpec``, refuses the threshold)."""
    extra = fields.get("kv_connector_extra_config") or {}
    if fields.get("kv_connector") != "OffloadingConnector" or not extra.get("spec_module_path"):
        return
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.get_spec_cls(extra)
    if getattr(spec, "get_manager", None) is not CPUOffloadingSpec.get_manager:
        raise ValueError(
            f"save: false: the offloading spec {spec.__name__} does not build its manager "
            "as CPUOffloadingSpec does, so it may not read store_threshold, which kvcompose "
            "sets to keep a non-saving OffloadingConnector from storing; remove save: false "
            "or use a spec that keeps CPUOffloadingSpec.get_manager"
        )


def child_class(config: VllmConfig, node: nodes.Node) -> type[KVConnectorBase_V1]:
    assert config.kv_transfer_config is not None
    try:
        cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ChildConfigError(
            f"node {node.name!r}: cannot load connector "
            f"{config.kv_transfer_config.kv_connector!r}: {exc}"
        ) from exc
    return cls  # type: ignore[return-value]


def leaf_class(leaf: nodes.Leaf) -> type[KVConnectorBase_V1]:
    """A leaf's connector class, resolved without a ``VllmConfig``."""

    class _Ktc:  # what get_connector_class reads
        kv_connector = leaf.connector
        kv_connector_module_path = leaf.module_path

    return KVConnectorFactory.get_connector_class(_Ktc)  # type: ignore[arg-type, return-value]


def hma_enabled(vllm_config: VllmConfig) -> bool:
    return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


def build_child(
    vllm_config: VllmConfig,
    role: Any,
    kv_cache_config: Any,
    node: nodes.Node,
    *,
    strict: bool,
    parent_saves: bool = True,
) -> Child:
    """``parent_saves``: whether the parent node really saves (its ``save`` and every
    ancestor's, as a nested composite's tree is handed down); the child saves only then."""
    hma = hma_enabled(vllm_config)
    config = child_vllm_config(vllm_config, node, strict=strict, hma=hma, parent_saves=parent_saves)
    cls = child_class(config, node)
    if hma and not supports_hma(cls):
        raise ChildConfigError(
            f"node {node.name!r}: {cls.__name__} does not support the hybrid KV cache manager "
            "(HMA), which is enabled; start vLLM with --disable-hybrid-kv-cache-manager or use "
            "children that support HMA"
        )
    try:
        connector = cls(config, role, kv_cache_config)
    except Exception as exc:  # vLLM shows the error; the note says which node raised it
        exc.add_note(f"(raised building kvcompose node {node.name!r}, a {cls.__name__})")
        raise
    saves = parent_saves and node.save
    return Child(name=node.name, spec=node, connector=connector, saves=saves)
