"""``PrefixStoreConnector``: the vLLM connector class, a facade over the two halves.

vLLM builds one instance per role (the scheduler's and one per worker) and calls each only
with its role's methods, so, as vLLM's own larger connectors do, the facade builds the half
for its role (:class:`PrefixStoreScheduler` or :class:`PrefixStoreWorker`) and delegates.
Subclasses swap the halves or the config through :attr:`config_class` and
:attr:`worker_class` (the fault-injecting test double in :mod:`kvcompose.testing.faulty_store`
does).

The class supports vLLM's hybrid KV cache manager (``SupportsHMA``): it loads and saves every
KV cache group by its own block ids (:mod:`~kvcompose.stores.prefix.groups`), so vLLM keeps
HMA on for it, and a kvcompose tree holding it can run with HMA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.stores.prefix.files import ChunkFiles, this_worker_tag, worker_tags
from kvcompose.stores.prefix.groups import KVGroups
from kvcompose.stores.prefix.keys import store_salt
from kvcompose.stores.prefix.metadata import PrefixStoreMetadata
from kvcompose.stores.prefix.scheduler import PrefixStoreScheduler
from kvcompose.stores.prefix.stats import PrefixStoreStats
from kvcompose.stores.prefix.tier import EVENT_MEDIUM, HIT_SOURCE, detect_medium
from kvcompose.stores.prefix.worker import PrefixStoreWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class PrefixStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefix-aware chunked disk KV store (see :mod:`kvcompose.stores.prefix`)."""

    _cache_hit_source = CacheHitSource.DISK
    #: The model ``kv_connector_extra_config`` is validated with.
    config_class: ClassVar[type[PrefixStoreConfig]] = PrefixStoreConfig
    #: The worker half's class.
    worker_class: ClassVar[type[PrefixStoreWorker]] = PrefixStoreWorker

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        #: The engine's KV cache groups (one unless vLLM's hybrid KV cache manager is on).
        self.groups = KVGroups.of(kv_cache_config)
        self.config = self.config_class.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        #: What holds the files: the hit source vLLM counts and the KV events' medium.
        self.medium = self.config.medium or detect_medium(self.config.path)
        self._cache_hit_source = HIT_SOURCE[self.medium]
        block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        tags = worker_tags(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        own_tag = this_worker_tag() if role == KVConnectorRole.WORKER and len(tags) > 1 else ""
        self.files = ChunkFiles(self.config.path, tags, own_tag)

        self.connector_scheduler: PrefixStoreScheduler | None = None
        self.connector_worker: PrefixStoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            ktc = self._kv_transfer_config
            chunk_tokens = self.config.chunk_blocks * block_size
            self.connector_scheduler = PrefixStoreScheduler(
                self.config,
                self.files,
                block_size=block_size,
                salt=store_salt(vllm_config, self.config.namespace, block_size, chunk_tokens),
                loads_enabled=ktc.is_kv_consumer,
                saves_enabled=ktc.is_kv_producer and not self.config.read_only,
                event_medium=EVENT_MEDIUM[self.medium] if _kv_events_on(vllm_config) else None,
                groups=self.groups,
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = self.worker_class(
                self.config,
                self.files,
                kv_cache_config=kv_cache_config,
                block_size=block_size,
                groups=self.groups,
            )

    @property
    def scheduler(self) -> PrefixStoreScheduler:
        if self.connector_scheduler is None:
            raise RuntimeError(f"PrefixStoreConnector: scheduler method called in role {self.role}")
        return self.connector_scheduler

    @property
    def worker(self) -> PrefixStoreWorker:
        if self.connector_worker is None:
            raise RuntimeError(f"PrefixStoreConnector: worker method called in role {self.role}")
        return self.connector_worker

    @property
    def total_stats(self) -> PrefixStoreStats:
        """Cumulative worker counters since start (tests, benchmark); empty elsewhere."""
        if self.connector_worker is None:
            return PrefixStoreStats()
        return self.connector_worker.total_stats

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is just a future miss.
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixStoreStats:
        return PrefixStoreStats(data=dict(data) if data else {})

    def get_kv_connector_stats(self) -> PrefixStoreStats | None:
        """The worker's I/O counters, or (scheduler role) the admission counters."""
        if self.connector_worker is not None:
            return self.connector_worker.interval_stats()
        if self.connector_scheduler is not None:
            return self.connector_scheduler.interval_stats()
        return None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from kvcompose.stores.prefix.prom import PrefixStorePromMetrics

        return PrefixStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================================================================ scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def set_load_range(self, request_id: str, start: int, end: int) -> None:
        """Place the next allocation's load at ``[start, …)``, at most ``end - start`` tokens
        (kvcompose's explicit load range; see ``PrefixStoreScheduler.set_load_range``)."""
        self.scheduler.set_load_range(request_id, start, end)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # The scheduler half keeps what it needs per request; the blocks a background
        # save holds are every group's (vLLM delays the free of all of them).
        return self.scheduler.request_finished(request)

    def take_events(self) -> list[Any]:
        """BlockStored events (medium: the tier's) of chunks the workers wrote."""
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        """Delete every chunk file (``/reset_prefix_cache?reset_external``)."""
        return self.scheduler.reset_cache()

    # =================================================================== worker

    def _step_metadata(self) -> PrefixStoreMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, PrefixStoreMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            meta = connector_metadata
            self.connector_worker.begin_step(
                meta if isinstance(meta, PrefixStoreMetadata) else None
            )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if (meta := self._step_metadata()) is not None:
            self.worker.start_load(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if (meta := self._step_metadata()) is not None:
            self.worker.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if (meta := self._step_metadata()) is not None:
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.worker.kv_cache_events()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.worker_meta()

    def shutdown(self) -> None:
        """Let the background writer finish what it queued."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


def _kv_events_on(vllm_config: VllmConfig) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))
