"""Building a composite's children as real vLLM connectors.

A leaf becomes whatever connector class vLLM's factory resolves for it. A nested composite
becomes another ``KVCompose`` instance, loaded through the same factory with its subtree in
``kv_connector_extra_config`` — nesting needs no special code because a composite *is* a
connector.

Each child gets its own shallow copy of the ``VllmConfig`` with its own ``KVTransferConfig``:
the parent's fields it does not set are inherited (upstream MultiConnector inherits none, and
crashes when a child sets its own ``engine_id``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

from kvcompose.tree import (
    OWN_FIELDS,
    TREE_KEY,
    Leaf,
    Node,
    child_transfer_config,
    dump_node,
    transfer_dict,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The class vLLM loads for a nested composite.
NESTED_CONNECTOR = "KVCompose"
NESTED_CONNECTOR_HMA = "KVComposeHMA"
NESTED_MODULE = "kvcompose"


class ChildConfigError(ValueError):
    """A child's connector cannot be built from its config."""


@dataclass
class Child:
    """One child of a composite node, as the node sees it."""

    name: str
    spec: Node
    connector: KVConnectorBase_V1
    saves: bool


def child_transfer_dict(parent: Any, spec: Node, *, strict: bool,
                        hma: bool) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields for ``spec`` as a child of ``parent`` (a
    ``KVTransferConfig`` or its dict): inherited fields, then the child's own."""
    if isinstance(spec, Leaf):
        return child_transfer_config(parent, spec)
    inherited = {k: v for k, v in transfer_dict(parent).items()
                 if k not in OWN_FIELDS and v is not None}
    return {**inherited,
            "kv_connector": NESTED_CONNECTOR_HMA if hma else NESTED_CONNECTOR,
            "kv_connector_module_path": NESTED_MODULE,
            "kv_connector_extra_config": {TREE_KEY: dump_node(spec), "strict": strict}}


def child_vllm_config(vllm_config: VllmConfig, spec: Node, *, strict: bool,
                      hma: bool) -> VllmConfig:
    assert vllm_config.kv_transfer_config is not None
    try:
        child_ktc = KVTransferConfig(**child_transfer_dict(
            vllm_config.kv_transfer_config, spec, strict=strict, hma=hma))
    except (TypeError, ValueError) as exc:
        raise ChildConfigError(f"node {spec.name!r}: invalid KVTransferConfig: {exc}") from exc
    config = copy.copy(vllm_config)
    config.kv_transfer_config = child_ktc
    return config


def child_class(config: VllmConfig, spec: Node) -> type[KVConnectorBase_V1]:
    assert config.kv_transfer_config is not None
    try:
        cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ChildConfigError(f"node {spec.name!r}: cannot load connector "
                               f"{config.kv_transfer_config.kv_connector!r}: {exc}") from exc
    return cls  # type: ignore[return-value]


def hma_enabled(vllm_config: VllmConfig) -> bool:
    return not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


def build_child(vllm_config: VllmConfig, role: Any, kv_cache_config: Any, spec: Node, *,
                strict: bool) -> Child:
    hma = hma_enabled(vllm_config)
    config = child_vllm_config(vllm_config, spec, strict=strict, hma=hma)
    cls = child_class(config, spec)
    if hma and not supports_hma(cls):
        raise ChildConfigError(
            f"node {spec.name!r}: {cls.__name__} does not support the hybrid KV cache manager "
            "(HMA), which is enabled; start vLLM with --disable-hybrid-kv-cache-manager or use "
            "children that support HMA")
    connector = cls(config, role, kv_cache_config)
    return Child(name=spec.name, spec=spec, connector=connector, saves=spec.save)
