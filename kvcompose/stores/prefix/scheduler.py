"""The scheduler half: lookups, and the loads and saves each step's metadata carries.

It runs in vLLM's scheduler process and never touches tensors: it decides from file
existence (:class:`~kvcompose.stores.prefix.files.ChunkFiles`) and the scheduler's own
request and block bookkeeping which chunks the workers load into which blocks, and which
freshly computed chunks they save.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcompose.stores.prefix.keys import chunk_keys, lookup_limit_chunks, request_salt
from kvcompose.stores.prefix.metadata import ChunkLoad, LoadSpec, PrefixStoreMetadata, SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvcompose.stores.prefix.config import PrefixStoreConfig
    from kvcompose.stores.prefix.files import ChunkFiles

logger = logging.getLogger(__name__)

#: How many scheduler steps a planned save counts as "on its way": dedupes saves of a chunk
#: shared by requests scheduled in consecutive steps, before its file exists.
INFLIGHT_SAVE_STEPS = 4
#: The key planned for tokens past the prompt's chunks (a caller asked for more than was
#: offered): it is never stored, so the worker reports the load failed.
NOT_STORED = "not-stored"


@dataclass
class _ReqState:
    """What the scheduler half remembers about a request between steps."""

    request: Request
    salt: str
    block_ids: list[int] = field(default_factory=list)
    #: Index of the next prompt chunk not yet considered for saving.
    next_save_chunk: int = 0
    keys: list[str] | None = None


class PrefixStoreScheduler:
    """Scheduler-side state and planning of one :class:`PrefixStoreConnector`."""

    def __init__(
        self,
        config: PrefixStoreConfig,
        files: ChunkFiles,
        *,
        block_size: int,
        salt: str,
        loads_enabled: bool,
        saves_enabled: bool,
    ) -> None:
        self.config = config
        self.files = files
        self.block_size = block_size
        self.chunk_tokens = config.chunk_blocks * block_size
        self.salt = salt
        self.is_async = config.load_mode == "async"
        self.loads_enabled = loads_enabled
        self.saves_enabled = saves_enabled
        self._reqs: dict[str, _ReqState] = {}
        #: Where the local prefix-cache hit ends, from the last lookup (places the load).
        self._lookup_local: dict[str, int] = {}
        #: Load ranges a caller set explicitly (``set_load_range``), until the allocation.
        self._load_ranges: dict[str, tuple[int, int]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        #: Requests whose async load failed: not offered the store again.
        self._no_store_reqs: set[str] = set()
        #: Chunk key -> step its save was planned.
        self._inflight_saves: dict[str, int] = {}
        self._step = 0
        self._warned_untracked = False

    # ----------------------------------------------------------------------- lookup

    def _prompt_keys(self, request: Request, salt: str) -> list[str]:
        state = self._reqs.get(request.request_id)
        if state is not None and state.keys is not None and state.salt == salt:
            return state.keys
        keys = chunk_keys(request.prompt_token_ids or [], self.chunk_tokens, salt)
        if state is not None and state.salt == salt:
            state.keys = keys
        return keys

    def stored_prefix_chunks(self, request: Request) -> int:
        """How many of the prompt's first chunks are stored (inside ``prompt[:-1]``)."""
        return self.stored_chunks_from(request, 0)

    def stored_chunks_from(self, request: Request, first: int) -> int:
        """How many consecutive prompt chunks from chunk ``first`` on are stored (inside
        ``prompt[:-1]``). A chunk's key hashes the whole prefix up to its end, so a stored
        chunk is valid whether or not the chunks before it are stored."""
        salt = request_salt(self.salt, request)
        if salt is None:
            return 0
        limit = lookup_limit_chunks(len(request.prompt_token_ids or []), self.chunk_tokens)
        n = 0
        for key in self._prompt_keys(request, salt)[first:limit]:
            if not self.files.stored(key):
                break
            n += 1
        return n

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The stored tokens after ``num_computed_tokens``, counted from the chunk holding
        it (chunk ``num_computed_tokens // C``): what the engine already holds need not be
        stored, so a tier holding only a later part of a prompt can load that part (a
        ``stitch`` chain's later segment)."""
        if not self.loads_enabled or request.request_id in self._no_store_reqs:
            return 0, False
        first = num_computed_tokens // self.chunk_tokens
        matched = (first + self.stored_chunks_from(request, first)) * self.chunk_tokens
        if matched <= num_computed_tokens:
            return 0, False
        # Remember where the local hit ends, to place the load; a pure memo that does not
        # change what this method returns.
        self._lookup_local[request.request_id] = num_computed_tokens
        return matched - num_computed_tokens, self.is_async

    # ------------------------------------------------------------------------ loads

    def set_load_range(self, req_id: str, start: int, end: int) -> None:
        """The next allocation's load is ``[start, start + n)`` with ``n <= end - start``,
        whatever the lookup's argument was (a composite stitching several children's ranges
        says so explicitly instead of relying on the lookup's memo). ``start`` must be on a
        block boundary."""
        if start % self.block_size or end < start:
            raise ValueError(
                f"PrefixStoreConnector: load range [{start}, {end}) for {req_id} does not "
                f"start on a block ({self.block_size} tokens)"
            )
        self._load_ranges[req_id] = (start, end)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        block_ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        salt = request_salt(self.salt, request)
        state = self._reqs.get(req_id)
        if salt is not None:
            if state is None or state.request is not request or state.salt != salt:
                state = _ReqState(request=request, salt=salt)
                self._reqs[req_id] = state
            state.block_ids = block_ids
        local = self._lookup_local.pop(req_id, None)
        explicit = self._load_ranges.pop(req_id, None)
        if num_external_tokens <= 0 or salt is None or state is None:
            return
        if explicit is not None:
            start, end = explicit
            if num_external_tokens > end - start:
                raise ValueError(
                    f"PrefixStoreConnector: {num_external_tokens} tokens allocated for "
                    f"{req_id}, more than its load range [{start}, {end})"
                )
            local = start
        if local is None:
            # Not looked up through this instance: the hit ends at the stored prefix.
            local = max(
                self.stored_prefix_chunks(request) * self.chunk_tokens - num_external_tokens, 0
            )
        self._pending_loads[req_id] = self._plan_load(
            req_id, state, local, local + num_external_tokens, block_ids
        )

    def _plan_load(
        self, req_id: str, state: _ReqState, start: int, end: int, block_ids: list[int]
    ) -> LoadSpec:
        """Load tokens [start, end) (start block-aligned) from the stored chunks."""
        bs = self.block_size
        c = self.chunk_tokens
        keys = self._prompt_keys(state.request, state.salt)
        chunks: list[ChunkLoad] = []
        for idx in range(start // c, (end + c - 1) // c):
            lo = max(start, idx * c)
            hi = min(end, (idx + 1) * c)
            first_blk = lo // bs
            last_blk = (hi + bs - 1) // bs  # exclusive
            chunks.append(
                ChunkLoad(
                    key=keys[idx] if idx < len(keys) else NOT_STORED,
                    first_block=first_blk - idx * self.config.chunk_blocks,
                    block_ids=block_ids[first_blk:last_blk],
                    num_tokens=hi - lo,
                )
            )
        return LoadSpec(
            req_id=req_id, chunks=chunks, is_async=self.is_async, num_tokens=end - start
        )

    # ------------------------------------------------------------------------- step

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixStoreMetadata:
        self._step += 1
        meta = PrefixStoreMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        if self.saves_enabled:
            self._plan_saves(scheduler_output, meta)
        # Forget planned saves old enough to have been written (or lost).
        for key in [
            k for k, s in self._inflight_saves.items() if self._step - s > INFLIGHT_SAVE_STEPS
        ]:
            del self._inflight_saves[key]
        return meta

    def _plan_saves(self, so: SchedulerOutput, meta: PrefixStoreMetadata) -> None:
        """Save every prompt chunk this step completes, once, unless it is stored."""
        planned: set[str] = set()
        for new_req in so.scheduled_new_reqs:
            state = self._reqs.get(new_req.req_id)
            if state is not None:
                state.block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            self._consider_saves(so, meta, planned, new_req.req_id, new_req.num_computed_tokens)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if state is not None and new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    state.block_ids = list(new_blocks[0])
                else:
                    state.block_ids.extend(new_blocks[0])
            self._consider_saves(so, meta, planned, req_id, cached.num_computed_tokens[i])

    def _consider_saves(
        self,
        so: SchedulerOutput,
        meta: PrefixStoreMetadata,
        planned: set[str],
        req_id: str,
        num_computed: int,
    ) -> None:
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
        spec_tokens = so.scheduled_spec_decode_tokens or {}
        # Speculative tokens are not prompt tokens and may be rejected.
        scheduled = so.num_scheduled_tokens.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
        done = min(num_computed + max(scheduled, 0), len(prompt))
        n_full = done // self.chunk_tokens
        if n_full <= state.next_save_chunk:
            return
        keys = self._prompt_keys(state.request, state.salt)
        cb = self.config.chunk_blocks
        for idx in range(state.next_save_chunk, n_full):
            key = keys[idx]
            if key in planned or key in self._inflight_saves or self.files.stored(key):
                continue
            blocks = state.block_ids[idx * cb : (idx + 1) * cb]
            if len(blocks) < cb:
                break
            planned.add(key)
            self._inflight_saves[key] = self._step
            meta.saves.append(
                SaveSpec(key=key, block_ids=list(blocks), num_tokens=self.chunk_tokens,
                         req_id=req_id)
            )  # fmt: skip
        state.next_save_chunk = n_full

    # ---------------------------------------------------------------- bookkeeping

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # A request whose async load failed is not offered the store again (with the
        # "recompute" policy vLLM looks it up once more).
        failed = getattr(connector_output, "failed_recving", None) or ()
        self._no_store_reqs.update(failed)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so its blocks are never held."""
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._lookup_local.pop(req_id, None)
        self._load_ranges.pop(req_id, None)
        self._no_store_reqs.discard(req_id)
        self._pending_loads.pop(req_id, None)
        return False, None

    def reset_cache(self) -> bool:
        """Delete every chunk file (``/reset_prefix_cache?reset_external``)."""
        if self.config.read_only:
            return False
        self.files.clear()
        self._inflight_saves.clear()
        return True
