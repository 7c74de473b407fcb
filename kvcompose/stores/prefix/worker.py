"""The worker half: moves whole KV-cache blocks between the paged cache and chunk files.

Each layer's cache is viewed with vLLM's (manager) blocks at dim 0 and blocks are copied as
opaque tiles, so a round trip is exact whatever an attention backend packs inside a block
(the CPU backend stores K transposed; :mod:`kvcompose.testing.cpu_tiles` decodes that
layout for a test). Loads run in ``start_load_kv`` before the step's forward; saves are
collected per layer in ``save_kv_layer`` and written in ``wait_for_save``, so a request's
blocks are never held after it finishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.stores.prefix.stats import PrefixStoreStats

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
        if not meta.loads:
            return
        caches = self._layer_caches(forward_context)
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
            progress.files.append(self.files.file(chunk.key))
            progress.chunks += 1
            progress.tokens += chunk.num_tokens
        return self.report_load(spec, progress, t0)

    def _copy_plan(
        self, chunk: ChunkLoad, caches: dict[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination cache, source tiles) per layer; raises if the file does not fit.

        Everything is read and checked before anything is copied, so a bad file leaves the
        cache untouched.
        """
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

    def begin_step(self) -> None:
        """A new step's metadata is bound: tiles of an earlier step are stale."""
        self._save_buf = {}

    def save_layer(self, meta: PrefixStoreMetadata, layer_name: str, kv_layer: Any) -> None:
        if not meta.saves or not isinstance(kv_layer, torch.Tensor):
            return
        grouped = self._by_block(kv_layer)
        for spec in meta.saves:
            idx = torch.tensor(spec.block_ids, dtype=torch.long, device=grouped.device)
            tiles = grouped.index_select(0, idx).to("cpu").contiguous()
            self._save_buf.setdefault(spec.key, {})[layer_name] = tiles

    def wait_for_save(self, meta: PrefixStoreMetadata) -> None:
        """Write the step's complete chunks, then evict down to ``max_chunks``."""
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
            if self.files.stored_here(spec.key):
                continue
            metadata = {
                "key": spec.key,
                "num_tokens": str(spec.num_tokens),
                "block_size": str(self.block_size),
                "chunk_blocks": str(self.config.chunk_blocks),
            }
            try:
                nbytes += self.files.write(spec.key, layers, metadata)
            except OSError as e:
                logger.warning(
                    "PrefixStoreConnector: could not write %s: %s", self.files.file(spec.key), e
                )
                continue
            chunks += 1
            tokens += spec.num_tokens
        self._save_buf = {}
        if chunks and self.config.max_chunks is not None:
            self.files.evict(self.config.max_chunks)
        self._record(
            chunks_saved=chunks,
            tokens_saved=tokens,
            bytes_saved=nbytes,
            save_time_s=time.perf_counter() - t0 if chunks else 0.0,
        )

    # ------------------------------------------------------------------ results

    def _record(self, **counts: int | float) -> None:
        self._interval_stats.add(**counts)
        self.total_stats.add(**counts)

    def transfer_results(self) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults(
            finished_sending=set(),
            finished_recving=self._finished_recving,
            failed_recving=self._failed_recving,
        )
        self._finished_recving = set()
        self._failed_recving = set()
        return res

    def block_ids_with_load_errors(self) -> set[int]:
        out = self._invalid_block_ids
        self._invalid_block_ids = set()
        return out

    def interval_stats(self) -> PrefixStoreStats | None:
        """This interval's counters (then reset), or None when nothing happened."""
        if self._interval_stats.is_empty():
            return None
        out = PrefixStoreStats(data=self._interval_stats.snapshot())
        self._interval_stats.reset()
        return out
