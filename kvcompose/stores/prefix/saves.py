"""The worker's save side: chunk files written from the step or by the writer thread, the
store's capacity kept after writes, and the KV cache events of what was written.

With ``save_mode: sync`` every saved chunk's blocks are collected per layer in
``save_kv_layer`` and written in ``wait_for_save``, so a request's blocks are never held
after it finishes. With ``save_mode: background`` ``wait_for_save`` only queues them for
the :class:`~kvcompose.stores.prefix.writer.ChunkWriter`, which writes the files from the
(held) blocks off the step.

Blocks in host memory, each one contiguous run (vLLM's CPU caches), are written straight
from the cache (:class:`~kvcompose.stores.prefix.safetensors_io.BlockRun`): nothing in the
step's forward writes a block whose tokens are already computed, and the background writer's
blocks are held until written. Other caches (device memory, heads outside blocks) are copied
out with ``index_select`` first. Copying every layer's tiles first made a save cost two
copies of its bytes; ``benchmarks/store_io.py`` measures it.

Under several KV cache groups each layer's blocks are its group's (``SaveSpec.blocks_of``);
the bytes written are also counted per group (``bytes_saved_group<i>``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvcompose.stores.prefix.files import store_usage
from kvcompose.stores.prefix.groups import KVGroups
from kvcompose.stores.prefix.safetensors_io import BlockRun
from kvcompose.stores.prefix.writer import ChunkWriter, WriteJob

if TYPE_CHECKING:
    from kvcompose.stores.prefix.config import PrefixStoreConfig
    from kvcompose.stores.prefix.files import ChunkFiles
    from kvcompose.stores.prefix.metadata import PrefixStoreMetadata
    from kvcompose.stores.prefix.stats import StoreCounters

logger = logging.getLogger(__name__)


class StoreSaves:
    """Saves of one :class:`~kvcompose.stores.prefix.worker.PrefixStoreWorker`."""

    def __init__(
        self,
        config: PrefixStoreConfig,
        files: ChunkFiles,
        *,
        block_size: int,
        by_block: Callable[[torch.Tensor], torch.Tensor],
        counters: StoreCounters,
        groups: KVGroups | None = None,
    ) -> None:
        self.config = config
        self.groups = groups or KVGroups.single()
        self.files = files
        self.block_size = block_size
        self._by_block = by_block
        self._counters = counters
        #: This step's saves: chunk key -> layer name -> its blocks (copied or in place).
        self._save_buf: dict[str, dict[str, torch.Tensor | BlockRun]] = {}
        #: KV cache events since the last step's collection, and the BlockStored event of
        #: every chunk this worker wrote and has not evicted (for its BlockRemoved).
        self._events_lock = threading.Lock()
        self._events: list[Any] = []
        self._published: dict[str, Any] = {}
        #: Background, capped: the writer wrote since the last eviction pass.
        self._evict_due = False
        #: An uncapped store's (chunks, bytes), counted up from one scan at the first write.
        self._occupancy: tuple[int, int] | None = None
        #: Background: this step's planned saves until ``wait_for_save`` queues them.
        self._unqueued: list[str] = []
        self.writer: ChunkWriter | None = None
        if config.save_mode == "background" and not config.read_only:
            self.writer = ChunkWriter(self._write_job, config.max_pending_saves)

    def begin_step(self, meta: PrefixStoreMetadata | None) -> None:
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
        group = self.groups.group_of(layer_name)
        for spec in meta.saves:
            blocks = _blocks(grouped, spec.blocks_of(group))
            self._save_buf.setdefault(spec.key, {})[layer_name] = blocks

    def wait_for_save(
        self,
        meta: PrefixStoreMetadata,
        registered: dict[str, torch.Tensor],
        step_caches: dict[str, torch.Tensor],
    ) -> None:
        """Write the step's complete chunks, then evict down to the capacity (sync), or
        queue them for the writer thread (background). ``registered`` are the caches vLLM
        registered (every layer a chunk must hold), ``step_caches`` this step's (the writer
        copies from them)."""
        if self.writer is not None:
            if self._evict_due:
                self._evict_due = False
                self._evict()
            if meta.saves:
                self._queue_saves(meta, step_caches or registered)
            return
        if not meta.saves:
            return
        t0 = time.perf_counter()
        expected = set(registered)
        chunks = tokens = nbytes = 0
        by_group: dict[str, int] = {}
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
            self._count_groups(by_group, layers)
        self._save_buf = {}
        if chunks:
            self._evict(chunks, nbytes)
        self._counters.add(
            chunks_saved=chunks,
            tokens_saved=tokens,
            bytes_saved=nbytes,
            save_time_s=time.perf_counter() - t0 if chunks else 0.0,
            **by_group,
        )

    def _count_groups(self, into: dict[str, int], layers: dict[str, Any]) -> None:
        """Add the bytes of ``layers`` per KV cache group (several groups only)."""
        if not self.groups.several:
            return
        for name, blocks in layers.items():
            key = f"bytes_saved_group{self.groups.group_of(name)}"
            into[key] = into.get(key, 0) + _nbytes(blocks)

    def _queue_saves(self, meta: PrefixStoreMetadata, caches: dict[str, torch.Tensor]) -> None:
        assert self.writer is not None
        self._unqueued = []
        if not caches:
            logger.error("PrefixStoreConnector: no KV cache layers registered; cannot save")
            self._counters.add(saves_dropped=len(meta.saves))
            self.writer.drop(spec.key for spec in meta.saves)
            return
        dropped = 0
        for spec in reversed(meta.saves):
            job = WriteJob(
                spec.key,
                spec.req_id,
                list(spec.block_ids),
                spec.num_tokens,
                caches,
                spec.event,
                groups=spec.groups,
                copies=self._windowed_copies(spec, caches),
            )
            if self.writer.submit(job) is False:
                dropped += 1
        if dropped:
            self._counters.add(saves_dropped=dropped)

    def _windowed_copies(
        self, spec: Any, caches: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The chunk's blocks of every layer in a windowed group, copied now: vLLM frees
        them once the request moves past them, before the writer gets to them."""
        if not any(self.groups.windowed):
            return {}
        copies = {}
        for name, kv in caches.items():
            group = self.groups.group_of(name)
            if self.groups.windowed[group]:
                ids = torch.tensor(spec.blocks_of(group), dtype=torch.long)
                copies[name] = self._by_block(kv).index_select(0, ids.to(kv.device)).cpu()
        return copies

    def _write_job(self, job: WriteJob) -> bool:
        """On the writer thread: copy the held blocks of every layer, write, evict; True
        when the chunk's file exists afterwards."""
        if self.files.stored_here(job.key):
            return True
        t0 = time.perf_counter()
        layers: dict[str, torch.Tensor | BlockRun] = {}
        for name in job.caches:
            src, ids = job.source(name, self.groups)
            layers[name] = src if name in job.copies else _blocks(self._by_block(src), ids)
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
        by_group: dict[str, int] = {}
        self._count_groups(by_group, layers)
        self._counters.add(
            chunks_saved=1,
            tokens_saved=job.num_tokens,
            bytes_saved=written,
            save_time_s=time.perf_counter() - t0,
            **by_group,
        )
        return True

    def _write_chunk(
        self,
        key: str,
        num_tokens: int,
        layers: dict[str, torch.Tensor | BlockRun],
        event: Any = None,
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
            with self._events_lock:
                self._events.append(event)
                self._published[key] = event
        return size

    def _evict(self, chunks: int = 0, nbytes: int = 0) -> None:
        """After writing ``chunks`` files of ``nbytes``: evict down to the capacity and
        record the occupancy left (an uncapped store counts up from one directory scan)."""
        cfg = self.config
        if cfg.max_chunks is None and cfg.max_bytes is None:
            if self._occupancy is None:
                usage = store_usage(self.files.path)
                self._occupancy = (usage["files"], usage["bytes"])
            else:
                self._occupancy = (self._occupancy[0] + chunks, self._occupancy[1] + nbytes)
            self._counters.set_level(
                occupancy_chunks=self._occupancy[0], occupancy_bytes=self._occupancy[1]
            )
            return
        occupancy = self.files.evict(cfg.max_chunks, cfg.max_bytes)
        if occupancy.evicted:
            self._counters.add(evictions=occupancy.evicted)
            self._publish_removed(occupancy.evicted_keys)
        self._counters.set_level(occupancy_chunks=occupancy.chunks, occupancy_bytes=occupancy.bytes)

    def _publish_removed(self, keys: tuple[str, ...]) -> None:
        """A ``BlockRemoved`` event for each evicted chunk whose ``BlockStored`` went out."""
        with self._events_lock:
            stored = [e for k in keys if (e := self._published.pop(k, None)) is not None]
            if not stored:
                return
            from vllm.distributed.kv_events import BlockRemoved

            self._events.extend(
                BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium) for e in stored
            )

    def take_events(self) -> list[Any]:
        """The events since the last call."""
        with self._events_lock:
            events, self._events = self._events, []
            return events


def _nbytes(blocks: torch.Tensor | BlockRun) -> int:
    if isinstance(blocks, BlockRun):
        return blocks.nbytes
    return blocks.numel() * blocks.element_size()


def _blocks(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor | BlockRun:
    """``cache[block_ids]`` to write: in place when the cache allows, else a host copy."""
    run = BlockRun.of(cache, block_ids)
    if run is not None:
        return run
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    return cache.index_select(0, idx).to("cpu").contiguous()
