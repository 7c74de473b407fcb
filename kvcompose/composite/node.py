"""``CompositeConnector``: one node of a kvcompose tree, and itself a vLLM connector.

A thin facade, split by role the way vLLM splits its larger connectors (``OffloadingConnector``,
``NixlConnector``): vLLM builds one instance per role, and each builds the children and the
half its role needs,

- SCHEDULER: ``CompositeScheduler`` (``scheduler.py``): the lookup policy, the ownership ledger,
  per-step loads and sends, finish accounting;
- WORKER: ``CompositeWorker`` (``worker.py``): owner-filtered completion signals, per-child
  failure containment;

and forwards every member of vLLM's ``KVConnectorBase_V1`` to the half that implements it, by
the rule written once in ``kvcompose.composite.rules`` (the drift test checks the two stay in
step). Members called on both sides (stats, shutdown) and class-level members live here. What
makes chain, fan-out and route differ is only the lookup policy (``policies``).

Each forwarded member is declared once below as a ``scheduler_member()`` or ``worker_member()``;
at construction the instance binds the half's own method in its place, so the split adds no
call on any path (the scheduler asks every waiting request every step). On an instance of the
other role such a member raises when called, naming the mistake.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcompose import tree as nodes
from kvcompose.composite.child_configs import child_transfer_dict
from kvcompose.composite.children import (
    Children,
    build_child,
    child_class,
    child_vllm_config,
    leaf_class,
)
from kvcompose.composite.guard import Guard
from kvcompose.composite.ledger import Ledger
from kvcompose.composite.metadata import CompositeMetadata
from kvcompose.composite.policies.factory import policy_class
from kvcompose.composite.scheduler import CompositeScheduler
from kvcompose.composite.stats import ComposedStats, NodeCounters, build_composed_prom_metrics
from kvcompose.composite.worker import CompositeWorker
from kvcompose.composite.worker_signals import WorkerSignals

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvcompose")


def as_composite(tree: nodes.Node) -> nodes.Composite:
    """A lone connector is a chain of one."""
    if isinstance(tree, nodes.Leaf):
        return nodes.Chain(name="root", children=(tree,))
    return tree


class _Member:
    """A connector member implemented by one half of the node (``side``: the attribute
    holding it); instances bind the half's method over this at construction."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.side), self.name)


def scheduler_member() -> Any:
    """A member vLLM calls on the SCHEDULER instance, implemented by ``CompositeScheduler``."""
    return _Member("scheduler_side")


def worker_member() -> Any:
    """A member vLLM calls on the WORKER instance, implemented by ``CompositeWorker``."""
    return _Member("worker_side")


class _OtherRole:
    """Stands in for the half this instance's role does not build: its methods raise when
    called, naming the mistake (reading them stays harmless, as on any connector)."""

    def __init__(self, node: str, half: type, role: KVConnectorRole) -> None:
        self._half = half
        self._where = (
            f"kvcompose[{node}]: {{}} is {half.__name__}'s; this is the {role.name} instance"
        )

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle and friends probe for these
            raise AttributeError(attr)
        message = self._where.format(attr)
        if not callable(getattr(self._half, attr, None)):
            raise RuntimeError(message)

        def wrong_role(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(message)

        return wrong_role


class CompositeConnector(KVConnectorBase_V1):
    """A chain, fan-out or route node. Subclasses only choose how the tree is read
    (``tree_from_config``), whether the class supports HMA, and ``ask_every_child``."""

    #: ``True``: a ``first`` lookup asks the children after the first hit too (the first
    #: hit still owns), as vLLM's MultiConnector does; ``kvcompose.compat`` sets it.
    ask_every_child: bool = False

    # ------------------------------------------------------------------ building
    @classmethod
    def tree_from_config(cls, extra_config: Mapping[str, Any]) -> nodes.Composite:
        """The node's tree, in the pre-validated form a parent composite hands its nested
        children (``TREE_KEY``). User documents are read by the entry classes
        (``kvcompose.KVCompose``), which override this."""
        if nodes.TREE_KEY not in extra_config:
            raise ValueError(
                f"kvcompose: kv_connector_extra_config holds no {nodes.TREE_KEY!r}; "
                f"{cls.__name__} reads only the tree a parent composite hands down. Load "
                "kvcompose.KVCompose (kv_connector_module_path 'kvcompose') to read a config"
            )
        return as_composite(nodes.parse_node(extra_config[nodes.TREE_KEY]))

    @staticmethod
    def strict_from_config(extra_config: Mapping[str, Any]) -> bool:
        return bool(extra_config.get("strict")) or os.environ.get("KVCOMPOSE_STRICT") == "1"

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.spec = self.tree_from_config(extra)
        self.name = self.spec.name
        self.strict = self.strict_from_config(extra)
        built = [
            build_child(
                vllm_config,
                role,
                kv_cache_config,
                child,
                strict=self.strict,
                parent_saves=self.spec.save,
            )
            for child in self.spec.children
        ]
        names = [c.name for c in built]
        self.counters = NodeCounters(names)
        on_error = [c.spec.on_error for c in built]
        self.guard = Guard(
            self.name,
            names,
            strict=self.strict,
            on_error=on_error,
            count=self.counters.inc,
            # ejection skips lookups: the scheduler half's (a worker's errors stay its own)
            eject=[c.spec.eject for c in built] if role is KVConnectorRole.SCHEDULER else None,
        )
        self.counters.on_lookup_timeout = self.guard.lookup_timed_out
        self.children = Children(built, self.guard)
        # vLLM's SimpleCPUOffload discovery duck-types on ``_connectors``.
        self._connectors = self.children.connectors
        self.scheduler_side = cast(
            CompositeScheduler, _OtherRole(self.name, CompositeScheduler, role)
        )
        self.worker_side = cast(CompositeWorker, _OtherRole(self.name, CompositeWorker, role))
        if role is KVConnectorRole.SCHEDULER:
            self.scheduler_side = CompositeScheduler(
                self.name,
                self.spec,
                self.children,
                self.counters,
                vllm_config,
                base_hit_sources=super().get_external_cache_hit_sources,
                base_group_ids=super().get_loaded_kv_cache_group_ids,
                ask_every_child=self.ask_every_child,
                num_kv_groups=len(kv_cache_config.kv_cache_groups) if kv_cache_config else 1,
            )
            self._bind_members("scheduler_side")
        else:
            timed = policy_class(self.spec).times_loads  # ``fastest`` prices loads by their times
            self.worker_side = CompositeWorker(self.name, self.children, timed=timed)
            self._bind_members("worker_side")

    def _bind_members(self, side: str) -> None:
        """Put the half's bound methods on the instance, over the class's declarations."""
        half = getattr(self, side)
        for name in dir(type(self)):
            member = getattr(type(self), name, None)
            if isinstance(member, _Member) and member.side == side:
                setattr(self, name, getattr(half, name))

    def refresh_child_methods(self) -> None:
        """Re-cache the children's hot-path methods after replacing one on a child instance
        (tracing, fault injection). Only the scheduler half caches them."""
        if self.role is KVConnectorRole.SCHEDULER:
            self.scheduler_side.refresh_child_methods()

    # ------------------------------------------------------------ introspection
    @property
    def ledger(self) -> Ledger:
        """The scheduler half's ownership ledger."""
        return self.scheduler_side.ledger

    @property
    def signals(self) -> WorkerSignals:
        """The worker half's signal filter."""
        return self.worker_side.signals

    def live_requests(self) -> dict[str, Any]:
        """Every per-request table of this node and its composite descendants that still
        holds something; ``{}`` when nothing is in flight (the leak check)."""
        scheduler = self.role is KVConnectorRole.SCHEDULER
        tables = self.scheduler_side.live() if scheduler else self.worker_side.live()
        for child in self.children:
            if isinstance(child.connector, CompositeConnector):
                nested = child.connector.live_requests()
                if nested:
                    tables[child.name] = nested
        return tables

    def stats_totals(self) -> dict[str, Any]:
        """Counters since start for this node and its composite descendants:
        ``{"node": name, "counters": {...}, "children": {name: {...}}}``."""
        nested = {
            c.name: c.connector.stats_totals()
            for c in self.children
            if isinstance(c.connector, CompositeConnector)
        }
        return {"node": self.name, "counters": dict(self.counters.totals), "children": nested}

    def ownership(self) -> dict[str, dict[str, object]]:
        """The live ownership table: request id → state, owner (child name), tokens, reason."""
        return self.scheduler_side.ownership()

    # ======================================================== scheduler side
    get_num_new_matched_tokens = scheduler_member()
    update_state_after_alloc = scheduler_member()
    get_external_cache_hit_sources = scheduler_member()
    get_loaded_kv_cache_group_ids = scheduler_member()
    build_connector_meta = scheduler_member()
    update_connector_output = scheduler_member()
    register_finished_partial_tail = scheduler_member()
    request_finished = scheduler_member()
    on_new_request = scheduler_member()
    take_events = scheduler_member()
    has_pending_block_frees = scheduler_member()
    has_pending_push_work = scheduler_member()
    bind_gpu_block_pool = scheduler_member()
    get_finished_count = scheduler_member()
    reset_cache = scheduler_member()
    set_xfer_handshake_metadata = scheduler_member()
    set_xfer_handshake_metadata_pp_aware = scheduler_member()

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.scheduler_side.divergent_hits  # read per lookup: taken from the children once

    @property
    def requires_kv_delivery(self) -> bool:
        return self.scheduler_side.requires_kv_delivery

    # =========================================================== worker side
    get_mem_pool_context = worker_member()
    register_kv_caches = worker_member()
    set_host_xfer_buffer_ops = worker_member()
    unregister_kv_caches = worker_member()
    restore_kv_caches = worker_member()
    finish_forward = worker_member()
    reset_capture_state = worker_member()
    handle_preemptions = worker_member()
    start_load_kv = worker_member()
    wait_for_layer_load = worker_member()
    save_kv_layer = worker_member()
    wait_for_save = worker_member()
    get_transfer_results = worker_member()
    get_finished = worker_member()
    get_block_ids_with_load_errors = worker_member()
    get_kv_connector_kv_cache_events = worker_member()
    get_handshake_metadata = worker_member()
    build_connector_worker_meta = worker_member()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, CompositeMetadata)
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker_side.clear_connector_metadata()

    # ============================================================= both sides
    def get_kv_connector_stats(self) -> ComposedStats | None:
        counters = self.counters
        if not (
            counters.changed
            or counters.lookups != counters.drained_lookups
            or self.children.implementing("get_kv_connector_stats")
        ):
            return None  # asked every step: nothing counted, no child has stats
        stats = ComposedStats.collect(self.name, self.children, self.counters)
        return None if stats is None or stats.is_empty() else stats

    def shutdown(self) -> None:
        first_error: BaseException | None = None
        for child in self.children:
            try:
                child.connector.shutdown()
            except Exception as exc:
                logger.error(
                    "kvcompose[%s]: child %r failed to shut down: %s", self.name, child.name, exc
                )
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    # ============================================================ class level
    @classmethod
    def _child_classes(
        cls, vllm_config: VllmConfig
    ) -> list[tuple[type[KVConnectorBase_V1], VllmConfig]]:
        assert vllm_config.kv_transfer_config is not None
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        tree = cls.tree_from_config(extra)
        strict = cls.strict_from_config(extra)
        out = []
        for child in tree.children:
            config = child_vllm_config(vllm_config, child, strict=strict, hma=False)
            out.append((child_class(config, child), config))
        return out

    @classmethod
    def _leaf_classes(
        cls, vllm_config: VllmConfig
    ) -> Iterator[tuple[type[KVConnectorBase_V1], VllmConfig]]:
        """Every leaf connector class of the tree with its config, depth first."""
        for child_cls, config in cls._child_classes(vllm_config):
            if issubclass(child_cls, CompositeConnector):
                yield from child_cls._leaf_classes(config)
            else:
                yield child_cls, config

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if vllm_config.kv_transfer_config is None:
            return None
        layouts = {}
        for child_cls, config in cls._child_classes(vllm_config):
            layout = child_cls.get_required_kvcache_layout(config)
            if layout is not None:
                layouts[child_cls.__name__] = layout
        if len(set(layouts.values())) > 1:
            raise ValueError(
                f"kvcompose: children require different KV-cache layouts: "
                f"{layouts}; they cannot share one KV cache"
            )
        return next(iter(layouts.values()), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        tree = cls.tree_from_config(extra_config)
        for child in tree.children:
            if isinstance(child, nodes.Leaf):
                child_cls = leaf_class(child)
                if child_cls.requires_piecewise_for_cudagraph(dict(child.extra_config)):
                    return True
            elif cls.requires_piecewise_for_cudagraph({nodes.TREE_KEY: nodes.dump_node(child)}):
                return True
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        from vllm.config import KVTransferConfig

        tree = cls.tree_from_config(kv_transfer_config.kv_connector_extra_config)
        for child in tree.children:
            ktc = KVTransferConfig(
                **child_transfer_dict(kv_transfer_config, child, strict=False, hma=False)
            )
            child_cls = leaf_class(child) if isinstance(child, nodes.Leaf) else cls
            check = getattr(child_cls, "supports_sleep_mode", None)
            if check is not None and not check(ktc):
                return False
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ComposedStats:
        return ComposedStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return build_composed_prom_metrics(
            cls._leaf_classes(vllm_config),
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
        )


class CompositeConnectorHMA(CompositeConnector, SupportsHMA):
    """The same node for the hybrid KV cache manager: vLLM decides HMA support per class."""

    request_finished_all_groups = scheduler_member()
