"""The worker half: moves whole KV-cache blocks between the paged cache and chunk files.

Each layer's cache is viewed with vLLM's (manager) blocks at dim 0 and blocks are copied as
opaque tiles, so a round trip is exact whatever an attention backend packs inside a block
(the CPU backend stores K transposed; :mod:`kvcompose.testing.cpu_tiles` decodes that
layout for a test). Loads run in ``start_load_kv`` before the step's forward
(:mod:`~kvcompose.stores.prefix.loads` copies the bytes); saves are
:mod:`~kvcompose.stores.prefix.saves`'s job. Under several KV cache groups each layer moves
its own group's blocks (:mod:`~kvcompose.stores.prefix.groups`), and the bytes loaded are
also counted per group (``bytes_loaded_group<i>``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.stores.prefix.groups import KVGroups
from kvcompose.stores.prefix.loads import (
    BlockTarget,
    LoadProgress,
    block_targets,
    copy_from_job,
    read_chunk,
)
from kvcompose.stores.prefix.metadata import StoreWorkerMeta
from kvcompose.stores.prefix.saves import StoreSaves
from kvcompose.stores.prefix.stats import PrefixStoreStats, StoreCounters
from kvcompose.stores.prefix.tier import StoreKVEvents

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.stores.prefix.config import PrefixStoreConfig
    from kvcompose.stores.prefix.files import ChunkFiles
    from kvcompose.stores.prefix.metadata import ChunkLoad, LoadSpec, PrefixStoreMetadata
    from kvcompose.stores.prefix.writer import ChunkWriter

__all__ = ["LoadProgress", "PrefixStoreWorker"]

logger = logging.getLogger(__name__)


class PrefixStoreWorker:
    """Worker-side state and I/O of one :class:`PrefixStoreConnector`."""

    def __init__(
        self,
        config: PrefixStoreConfig,
        files: ChunkFiles,
        *,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        groups: KVGroups | None = None,
    ) -> None:
        self.config = config
        self.files = files
        self.kv_cache_config = kv_cache_config
        self.groups = groups or KVGroups.single()
        self.block_size = block_size
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._counters = StoreCounters()
        #: Cumulative counters since start (tests, benchmark); never reset.
        self.total_stats = self._counters.total
        #: The layer caches of the latest step (the writer copies blocks from them).
        self._step_caches: dict[str, torch.Tensor] = {}
        self.saves = StoreSaves(
            config,
            files,
            block_size=block_size,
            by_block=self._by_block,
            counters=self._counters,
            groups=self.groups,
        )

    @property
    def writer(self) -> ChunkWriter | None:
        """The background writer (``save_mode: background``), else None."""
        return self.saves.writer

    # ------------------------------------------------------------------- caches

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = {
            name: kv for name, kv in kv_caches.items() if isinstance(kv, torch.Tensor)
        }

    def _layer_caches(self, forward_context: ForwardContext | None) -> dict[str, torch.Tensor]:
        """The registered caches, or the forward context's (some runners register none)."""
        if self._kv_caches:
            return self._kv_caches
        caches: dict[str, torch.Tensor] = {}
        if forward_context is not None:
            for name, layer in forward_context.no_compile_layers.items():
                kv = getattr(layer, "kv_cache", None)
                if isinstance(kv, list | tuple):
                    kv = kv[0] if kv else None
                if isinstance(kv, torch.Tensor) and kv.numel() > 0:
                    caches[name] = kv
        return caches

    def _by_block(self, kv: torch.Tensor) -> torch.Tensor:
        """View a layer cache with vLLM (manager) blocks at dim 0.

        Every layout vLLM hands connectors keeps blocks at dim 0 (kernel blocks, several
        per manager block when the attention kernel splits them), so moving whole blocks
        as opaque tiles is exact whatever the interior layout is.
        """
        num_blocks = self.kv_cache_config.num_blocks
        if kv.shape[0] == num_blocks:
            return kv
        return kv.unflatten(0, (num_blocks, -1))

    # -------------------------------------------------------------------- loads

    def start_load(self, meta: PrefixStoreMetadata, forward_context: ForwardContext) -> None:
        caches = self._layer_caches(forward_context)
        self._step_caches = caches
        if not meta.loads:
            return
        for spec in meta.loads:
            ok = self.load(spec, caches)
            if spec.is_async:
                self._finished_recving.add(spec.req_id)
                if not ok:
                    self._failed_recving.add(spec.req_id)

    def load(self, spec: LoadSpec, caches: dict[str, torch.Tensor]) -> bool:
        """Load one request's chunks into ``caches``; False when any chunk failed."""
        t0 = time.perf_counter()
        if not caches:
            logger.error("PrefixStoreConnector: no KV cache layers registered; cannot load")
            return self.report_load(spec, LoadProgress(failed_from=0), t0)
        targets = block_targets({name: self._by_block(kv) for name, kv in caches.items()})
        progress = LoadProgress()
        for i, chunk in enumerate(spec.chunks):
            try:
                progress.nbytes += self._load_chunk(chunk, targets)
            except Exception as e:  # missing, truncated or foreign file
                logger.warning("PrefixStoreConnector: load of chunk %s failed: %s", chunk.key, e)
                progress.failed_from = i
                break
            self._count_groups(progress.by_group, chunk, targets)
            if self.files.stored_here(chunk.key):
                progress.files.append(self.files.file(chunk.key))
            progress.chunks += 1
            progress.tokens += chunk.num_tokens
        self._emulate_read(progress.nbytes, t0)
        return self.report_load(spec, progress, t0)

    def _load_chunk(self, chunk: ChunkLoad, targets: dict[str, BlockTarget]) -> int:
        """Copy one chunk into ``targets``; its bytes. A chunk the background writer has
        not written yet is copied from the blocks its job holds."""
        job = self.writer.job_for(chunk.key) if self.writer is not None else None
        groups = self.groups if self.groups.several else None
        if job is not None and not self.files.stored_here(chunk.key):
            dsts = {name: t.tensor for name, t in targets.items()}
            return copy_from_job(chunk, job, dsts, self._by_block, groups)
        return read_chunk(self.files.file(chunk.key), chunk, targets, groups)

    def _count_groups(
        self, into: dict[str, int], chunk: ChunkLoad, targets: dict[str, BlockTarget]
    ) -> None:
        """Add the bytes a loaded chunk put into each KV cache group (several groups only)."""
        if not self.groups.several:
            return
        for name, target in targets.items():
            group = self.groups.group_of(name)
            key = f"bytes_loaded_group{group}"
            blocks = len(chunk.for_group(group).block_ids)
            into[key] = into.get(key, 0) + blocks * target.tensor[0].nbytes

    def _emulate_read(self, nbytes: int, t0: float) -> None:
        """``emulate_read``: sleep until the load has taken latency + bytes / bandwidth."""
        emulate = self.config.emulate_read
        if emulate is None:
            return
        left = t0 + emulate.min_seconds(nbytes) - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self._counters.add(emulated_wait_s=left)

    def report_load(self, spec: LoadSpec, progress: LoadProgress, t0: float) -> bool:
        """Touch the loaded files, count, and mark what failed; True when all loaded.

        A failed sync load reports the blocks of every chunk from the failed one on, so
        vLLM recomputes exactly those (async loads fail request-level instead).
        """
        # Touch in reverse prefix order: a chain's first chunks are evicted last.
        if not self.config.read_only:
            for path in reversed(progress.files):
                self.files.touch(path)
        counts: dict[str, int | float] = {
            "chunks_loaded": progress.chunks,
            "tokens_loaded": progress.tokens,
            "bytes_loaded": progress.nbytes,
            "load_time_s": time.perf_counter() - t0,
            **progress.by_group,
        }
        if progress.failed_from is not None:
            counts["load_failures"] = 1
            # Under several groups every load is async (the scheduler half's choice):
            # vLLM's Scheduler._handle_invalid_blocks raises on block ids there.
            if not spec.is_async and not self.groups.several:
                for chunk in spec.chunks[progress.failed_from :]:
                    self._invalid_block_ids.update(chunk.block_ids)
        self._counters.add(**counts)
        return progress.failed_from is None

    # -------------------------------------------------------------------- saves

    def begin_step(self, meta: PrefixStoreMetadata | None = None) -> None:
        """A new step's metadata is bound (see :meth:`StoreSaves.begin_step`)."""
        self.saves.begin_step(meta)

    def save_layer(self, meta: PrefixStoreMetadata, layer_name: str, kv_layer: Any) -> None:
        self.saves.save_layer(meta, layer_name, kv_layer)

    def wait_for_save(self, meta: PrefixStoreMetadata) -> None:
        self.saves.wait_for_save(meta, self._kv_caches, self._step_caches)

    def shutdown(self) -> None:
        """Write what the background writer still holds, then stop it."""
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ results

    def transfer_results(self) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults(
            finished_sending=self.writer.take_finished() if self.writer is not None else set(),
            finished_recving=self._finished_recving,
            failed_recving=self._failed_recving,
        )
        self._finished_recving = set()
        self._failed_recving = set()
        return res

    def worker_meta(self) -> StoreWorkerMeta | None:
        """Background writes written or dropped since the last step (the scheduler half
        offers queued chunks to lookups until it hears of them)."""
        if self.writer is None:
            return None
        written, dropped = self.writer.take_outcomes()
        if not written and not dropped:
            return None
        return StoreWorkerMeta(written=written, dropped=dropped)

    def kv_cache_events(self) -> StoreKVEvents | None:
        """The events of chunks written since the last call (vLLM collects them each step)."""
        events = self.saves.take_events()
        if not events:
            return None
        out = StoreKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def block_ids_with_load_errors(self) -> set[int]:
        out = self._invalid_block_ids
        self._invalid_block_ids = set()
        return out

    def interval_stats(self) -> PrefixStoreStats | None:
        """This interval's counters (then reset), or None when nothing happened."""
        return self._counters.take_interval()
