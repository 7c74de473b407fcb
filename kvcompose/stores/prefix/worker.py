"""The worker half: moves whole KV-cache blocks between the paged cache and chunk files.

Each layer's cache is viewed with vLLM's (manager) blocks at dim 0 and blocks are copied as
opaque tiles, so a round trip is exact whatever an attention backend packs inside a block
(the CPU backend stores K transposed; :mod:`kvcompose.testing.cpu_tiles` decodes that
layout for a test). Loads run in ``start_load_kv`` before the step's forward. Saves, with
``save_mode: sync``, are collected per layer in ``save_kv_layer`` and written in
``wait_for_save``, so a request's blocks are never held after it finishes; with
``save_mode: background`` ``wait_for_save`` only queues them for the
:class:`~kvcompose.stores.prefix.writer.ChunkWriter`, which copies the (held) blocks and
writes the files off the step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.stores.prefix.files import store_usage
from kvcompose.stores.prefix.metadata import StoreWorkerMeta
from kvcompose.stores.prefix.stats import PrefixStoreStats
from kvcompose.stores.prefix.tier import StoreKVEvents
from kvcompose.stores.prefix.writer import ChunkWriter, WriteJob

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvcompose.stores.prefix.config import PrefixStoreConfig
    from kvcompose.stores.prefix.files import ChunkFiles
    from kvcompose.stores.prefix.metadata import ChunkLoad, LoadSpec, PrefixStoreMetadata

logger = logging.getLogger(__name__)


@dataclass
class LoadProgress:
    """How far one request's load got; ``failed_from`` is the first chunk not loaded."""

    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0
    files: list[str] = field(default_factory=list)
    failed_from: int | None = None


class PrefixStoreWorker:
    """Worker-side state and I/O of one :class:`PrefixStoreConnector`."""

    def __init__(
        self,
        config: PrefixStoreConfig,
        files: ChunkFiles,
        *,
        kv_cache_config: KVCacheConfig,
        block_size: int,
    ) -> None:
        self.config = config
        self.files = files
        self.kv_cache_config = kv_cache_config
        self.block_size = block_size
        self._kv_caches: dict[str, torch.Tensor] = {}
        #: This step's saved tiles: chunk key -> layer name -> tiles.
        self._save_buf: dict[str, dict[str, torch.Tensor]] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._interval_stats = PrefixStoreStats()
        #: Cumulative counters since start (tests, benchmark); never reset.
        self.total_stats = PrefixStoreStats()
        #: The writer thread records its counters too.
        self._stats_lock = threading.Lock()
        #: The layer caches of the latest step (the writer copies blocks from them).
        self._step_caches: dict[str, torch.Tensor] = {}
        #: KV cache events since the last step's collection, and the BlockStored event of
        #: every chunk this worker wrote and has not evicted (for its BlockRemoved).
        self._events: list[Any] = []
        self._published: dict[str, Any] = {}
        self.writer: ChunkWriter | None = None
        #: Background, capped: the writer wrote since the last eviction pass.
        self._evict_due = False
        #: An uncapped store's (chunks, bytes), counted up from one scan at the first write.
        self._occupancy: tuple[int, int] | None = None
        #: Background: this step's planned saves until ``wait_for_save`` queues them.
        self._unqueued: list[str] = []
        if config.save_mode == "background" and not config.read_only:
            self.writer = ChunkWriter(self._write_job, config.max_pending_saves)

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
        progress = LoadProgress()
        for i, chunk in enumerate(spec.chunks):
            try:
                plan = self._copy_plan(chunk, caches)
            except Exception as e:  # missing, truncated or foreign file
                logger.warning("PrefixStoreConnector: load of chunk %s failed: %s", chunk.key, e)
                progress.failed_from = i
                break
            idx = torch.tensor(chunk.block_ids, dtype=torch.long)
            for dst, src in plan:
                dst.index_copy_(0, idx.to(dst.device), src.to(dst.device, non_blocking=True))
                progress.nbytes += src.numel() * src.element_size()
            if self.files.stored_here(chunk.key):
                progress.files.append(self.files.file(chunk.key))
            progress.chunks += 1
            progress.tokens += chunk.num_tokens
        return self.report_load(spec, progress, t0)

    def _copy_plan(
        self, chunk: ChunkLoad, caches: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination cache, source tiles) per layer; raises if the file does not fit.

        Everything is read and checked before anything is copied, so a bad file leaves the
        cache untouched. A chunk the background writer has not written yet is copied from
        the blocks its job holds.
        """
        job = self.writer.job_for(chunk.key) if self.writer is not None else None
        if job is not None and not self.files.stored_here(chunk.key):
            return self._copy_plan_from_job(chunk, job, caches)
        tensors = self.files.read(chunk.key)
        plan = []
        n = len(chunk.block_ids)
        for name, kv in caches.items():
            dst = self._by_block(kv)
            src = tensors[name]
            if (
                src.dtype != dst.dtype
                or tuple(src.shape[1:]) != tuple(dst.shape[1:])
                or src.shape[0] < chunk.first_block + n
            ):
                raise ValueError(
                    f"layer {name}: stored {tuple(src.shape)}/{src.dtype} does not fit "
                    f"cache blocks {tuple(dst.shape[1:])}/{dst.dtype}"
                )
            plan.append((dst, src[chunk.first_block : chunk.first_block + n]))
        return plan

    def _copy_plan_from_job(
        self, chunk: ChunkLoad, job: WriteJob, caches: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination cache, source blocks) per layer, from a queued write's held blocks
        (vLLM frees them only after the write, and this step's forward does not touch them)."""
        n = len(chunk.block_ids)
        src_ids = job.block_ids[chunk.first_block : chunk.first_block + n]
        if len(src_ids) < n or set(caches) - set(job.caches):
            raise ValueError(f"queued chunk {chunk.key} does not cover the load")
        plan = []
        for name, kv in caches.items():
            dst = self._by_block(kv)
            src = self._by_block(job.caches[name])
            idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
            plan.append((dst, src.index_select(0, idx)))
        return plan

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
        }
        if progress.failed_from is not None:
            counts["load_failures"] = 1
            if not spec.is_async:
                for chunk in spec.chunks[progress.failed_from :]:
                    self._invalid_block_ids.update(chunk.block_ids)
        self._record(**counts)
        return progress.failed_from is None

    # -------------------------------------------------------------------- saves

    def begin_step(self, meta: PrefixStoreMetadata | None = None) -> None:
        """A new step's metadata is bound: tiles of an earlier step are stale. The
        background writer writes the queued chunks of preempted requests now (vLLM reuses
        their blocks from this step's forward on) and learns which held requests finished.
        Saves of the previous step that were never queued (a composite calls
        ``wait_for_save`` only on saving children) are reported dropped, so the scheduler
        half stops offering them."""
        self._save_buf = {}
        if self.writer is None:
            return
        if self._unqueued:
            self.writer.drop(self._unqueued)
            self._unqueued = []
        if meta is None:
            return
        self._unqueued = [spec.key for spec in meta.saves]
        if meta.preempted:
            self.writer.write_now(meta.preempted)
        for req_id in meta.finished_saves:
            self.writer.request_finished(req_id)

    def save_layer(self, meta: PrefixStoreMetadata, layer_name: str, kv_layer: Any) -> None:
        if not meta.saves or not isinstance(kv_layer, torch.Tensor) or self.writer is not None:
            return
        grouped = self._by_block(kv_layer)
        for spec in meta.saves:
            idx = torch.tensor(spec.block_ids, dtype=torch.long, device=grouped.device)
            tiles = grouped.index_select(0, idx).to("cpu").contiguous()
            self._save_buf.setdefault(spec.key, {})[layer_name] = tiles

    def wait_for_save(self, meta: PrefixStoreMetadata) -> None:
        """Write the step's complete chunks, then evict down to the capacity (sync), or
        queue them for the writer thread (background)."""
        if self.writer is not None:
            if self._evict_due:
                self._evict_due = False
                self._evict()
            if meta.saves:
                self._queue_saves(meta)
            return
        if not meta.saves:
            return
        t0 = time.perf_counter()
        expected = set(self._kv_caches)
        chunks = tokens = nbytes = 0
        # Reverse prefix order: a chain's first chunks get the newest mtime.
        for spec in reversed(meta.saves):
            layers = self._save_buf.get(spec.key)
            if not layers or (expected and not expected.issubset(layers)):
                continue
            written = self._write_chunk(spec.key, spec.num_tokens, layers, spec.event)
            if written is None:
                continue
            chunks += 1
            tokens += spec.num_tokens
            nbytes += written
        self._save_buf = {}
        if chunks:
            self._evict(chunks, nbytes)
        self._record(
            chunks_saved=chunks,
            tokens_saved=tokens,
            bytes_saved=nbytes,
            save_time_s=time.perf_counter() - t0 if chunks else 0.0,
        )

    def _queue_saves(self, meta: PrefixStoreMetadata) -> None:
        assert self.writer is not None
        self._unqueued = []
        caches = self._step_caches or self._kv_caches
        if not caches:
            logger.error("PrefixStoreConnector: no KV cache layers registered; cannot save")
            self._record(saves_dropped=len(meta.saves))
            self.writer.drop(spec.key for spec in meta.saves)
            return
        dropped = 0
        for spec in reversed(meta.saves):
            job = WriteJob(
                spec.key, spec.req_id, list(spec.block_ids), spec.num_tokens, caches, spec.event
            )
            if self.writer.submit(job) is False:
                dropped += 1
        if dropped:
            self._record(saves_dropped=dropped)

    def _write_job(self, job: WriteJob) -> bool:
        """On the writer thread: copy the held blocks of every layer, write, evict; True
        when the chunk's file exists afterwards."""
        if self.files.stored_here(job.key):
            return True
        t0 = time.perf_counter()
        layers = {}
        for name, kv in job.caches.items():
            grouped = self._by_block(kv)
            idx = torch.tensor(job.block_ids, dtype=torch.long, device=grouped.device)
            layers[name] = grouped.index_select(0, idx).to("cpu").contiguous()
        written = self._write_chunk(job.key, job.num_tokens, layers, job.event)
        if written is None:
            return False
        if self.config.max_chunks is None and self.config.max_bytes is None:
            self._evict(1, written)  # counts occupancy up; deletes nothing
        else:
            # Deleting here could remove a chunk a lookup has just promised and the step
            # is about to load; evict between steps instead (``wait_for_save``), where a
            # synchronous store evicts too.
            self._evict_due = True
        self._record(
            chunks_saved=1,
            tokens_saved=job.num_tokens,
            bytes_saved=written,
            save_time_s=time.perf_counter() - t0,
        )
        return True

    def _write_chunk(
        self, key: str, num_tokens: int, layers: dict[str, torch.Tensor], event: Any = None
    ) -> int | None:
        """Write one chunk's file unless it exists; its size, or None when not written.
        A written chunk's ``BlockStored`` event (when events are on) is published."""
        if self.files.stored_here(key):
            return None
        metadata = {
            "key": key,
            "num_tokens": str(num_tokens),
            "block_size": str(self.block_size),
            "chunk_blocks": str(self.config.chunk_blocks),
        }
        try:
            size = self.files.write(key, layers, metadata)
        except OSError as e:
            logger.warning("PrefixStoreConnector: could not write %s: %s", self.files.file(key), e)
            return None
        if event is not None:
            with self._stats_lock:
                self._events.append(event)
                self._published[key] = event
        return size

    def _evict(self, chunks: int = 0, nbytes: int = 0) -> None:
        """After writing ``chunks`` files of ``nbytes``: evict down to the capacity and
        record the occupancy left (an uncapped store counts up from one directory scan)."""
        cfg = self.config
        if cfg.max_chunks is None and cfg.max_bytes is None:
            with self._stats_lock:
                if self._occupancy is None:
                    usage = store_usage(self.files.path)
                    self._occupancy = (usage["files"], usage["bytes"])
                else:
                    self._occupancy = (self._occupancy[0] + chunks, self._occupancy[1] + nbytes)
                levels = {
                    "occupancy_chunks": self._occupancy[0],
                    "occupancy_bytes": self._occupancy[1],
                }
                self._interval_stats.set_level(**levels)
                self.total_stats.set_level(**levels)
            return
        occupancy = self.files.evict(cfg.max_chunks, cfg.max_bytes)
        if occupancy.evicted:
            self._record(evictions=occupancy.evicted)
            self._publish_removed(occupancy.evicted_keys)
        with self._stats_lock:
            levels = {"occupancy_chunks": occupancy.chunks, "occupancy_bytes": occupancy.bytes}
            self._interval_stats.set_level(**levels)
            self.total_stats.set_level(**levels)

    def _publish_removed(self, keys: tuple[str, ...]) -> None:
        """A ``BlockRemoved`` event for each evicted chunk whose ``BlockStored`` went out."""
        with self._stats_lock:
            stored = [e for k in keys if (e := self._published.pop(k, None)) is not None]
            if not stored:
                return
            from vllm.distributed.kv_events import BlockRemoved

            self._events.extend(
                BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium) for e in stored
            )

    def shutdown(self) -> None:
        """Write what the background writer still holds, then stop it."""
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ results

    def _record(self, **counts: int | float) -> None:
        with self._stats_lock:
            self._interval_stats.add(**counts)
            self.total_stats.add(**counts)

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
        with self._stats_lock:
            if not self._events:
                return None
            events, self._events = self._events, []
        out = StoreKVEvents(num_workers=1)
        out.add_events(events)
        return out

    def block_ids_with_load_errors(self) -> set[int]:
        out = self._invalid_block_ids
        self._invalid_block_ids = set()
        return out

    def interval_stats(self) -> PrefixStoreStats | None:
        """This interval's counters (then reset), or None when nothing happened."""
        with self._stats_lock:
            if self._interval_stats.is_empty():
                return None
            out = PrefixStoreStats(data=self._interval_stats.snapshot())
            self._interval_stats.reset()
            return out
