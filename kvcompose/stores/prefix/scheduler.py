"""The scheduler half: lookups, and the loads and saves each step's metadata carries.

It runs in vLLM's scheduler process and never touches tensors: it decides from file
existence (:class:`~kvcompose.stores.prefix.files.ChunkFiles`) and the scheduler's own
request and block bookkeeping which chunks the workers load into which blocks, and which
freshly computed chunks they save.

Under several KV cache groups (:mod:`~kvcompose.stores.prefix.groups`) a load places every
group's blocks by that group's block ids and skips vLLM's null blocks (a windowed group gets
the window before the load's end), and a chunk is saved only while every group holds all of
its blocks. Every load is then asynchronous, whatever ``load_mode`` says: a failed load must
reach vLLM by request (``failed_recving``), because ``Scheduler._handle_invalid_blocks``
refuses block ids (the only report of a failed synchronous load) under several groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcompose.stores.prefix.admission import Admission, AdmissionRule
from kvcompose.stores.prefix.groups import KVGroups, all_real, window_blocks
from kvcompose.stores.prefix.keys import chunk_keys, lookup_limit_chunks, request_salt
from kvcompose.stores.prefix.metadata import (
    ChunkLoad,
    LoadSpec,
    PrefixStoreMetadata,
    SaveSpec,
    StoreWorkerMeta,
)
from kvcompose.stores.prefix.stats import PrefixStoreStats
from kvcompose.stores.prefix.tier import StoreKVEvents

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
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
    #: Per KV cache group, the request's block ids as the scheduler output told them.
    block_ids: list[list[int]] = field(default_factory=list)
    #: Index of the next prompt chunk not yet considered for saving.
    next_save_chunk: int = 0
    keys: list[str] | None = None
    #: Tokens [local_hit, first_computed) were loaded by some tier when the request was
    #: first scheduled (this store's own loads are stored here already): promotion range.
    local_hit: int | None = None
    first_computed: int | None = None
    #: Whether the store's ``admit_when`` selects the request (judged once, on first save).
    selected: bool | None = None


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
        event_medium: str | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        self.config = config
        self.files = files
        self.block_size = block_size
        self.chunk_tokens = config.chunk_blocks * block_size
        self.salt = salt
        self.groups = groups or KVGroups.single()
        # Several groups: asynchronous, so that a failed load is reported by request.
        self.is_async = config.load_mode == "async" or self.groups.several
        #: vLLM's KV cache manager (``bind_kv_cache_manager``): a windowed group's block
        #: ids are read from it when saves are planned (vLLM nulls blocks behind the window
        #: without telling connectors).
        self._manager: KVCacheManager | None = None
        self.loads_enabled = loads_enabled
        self.saves_enabled = saves_enabled
        self._reqs: dict[str, _ReqState] = {}
        #: Where the local prefix-cache hit ends, from the last lookup (places the load).
        self._lookup_local: dict[str, int] = {}
        #: Where the local hit ends, from every lookup (promote only).
        self._local_hit: dict[str, int] = {}
        #: Load ranges a caller set explicitly (``set_load_range``), until the allocation.
        self._load_ranges: dict[str, tuple[int, int]] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        #: Requests whose async load failed: not offered the store again.
        self._no_store_reqs: set[str] = set()
        #: Chunk key -> step its save was planned.
        self._inflight_saves: dict[str, int] = {}
        self._step = 0
        self._warned_untracked = False
        #: Background saves: requests with saves planned (their blocks are held when they
        #: finish), and the finished ones the next step's metadata tells the worker about.
        self.background = config.save_mode == "background"
        self._saving_reqs: set[str] = set()
        self._finished_saves: list[str] = []
        #: Chunks queued for the background writer and not yet reported written or dropped:
        #: offered to lookups (the worker copies them from the held blocks).
        self._queued: set[str] = set()
        self.admission = Admission(AdmissionRule.from_config(config))
        #: Admits, rejects and promotions since the last stats collection, and since start.
        self.stats = PrefixStoreStats()
        self.total_stats = PrefixStoreStats()
        #: ``medium`` of the BlockStored events the workers publish (None: no events).
        self.event_medium = event_medium
        self._events: list[Any] = []

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._manager = manager

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
        queued = self._queued
        for key in self._prompt_keys(request, salt)[first:limit]:
            if key not in queued and not self.files.stored(key):
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
        if self.admission.rule.promote:
            self._local_hit[request.request_id] = num_computed_tokens
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
        block_ids = [list(g) for g in blocks.get_block_ids()] if blocks is not None else []
        salt = request_salt(self.salt, request)
        state = self._reqs.get(req_id)
        if salt is not None:
            if state is None or state.request is not request or state.salt != salt:
                state = _ReqState(request=request, salt=salt)
                self._reqs[req_id] = state
                if self.admission.sketch is not None and self.saves_enabled:
                    self.admission.seen(self._prompt_keys(request, salt))
            state.block_ids = block_ids
            if req_id in self._local_hit:
                state.local_hit = self._local_hit.pop(req_id)
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
        self, req_id: str, state: _ReqState, start: int, end: int, block_ids: list[list[int]]
    ) -> LoadSpec:
        """Load tokens [start, end) (start block-aligned) from the stored chunks, into each
        group's blocks of those tokens that are not null (a windowed group's window)."""
        bs = self.block_size
        c = self.chunk_tokens
        keys = self._prompt_keys(state.request, state.salt)
        chunks: list[ChunkLoad] = []
        for idx in range(start // c, (end + c - 1) // c):
            lo = max(start, idx * c)
            hi = min(end, (idx + 1) * c)
            first_blk = lo // bs
            last_blk = (hi + bs - 1) // bs  # exclusive
            offset = first_blk - idx * self.config.chunk_blocks
            groups = []
            for ids in block_ids or [[]]:
                skipped, window = window_blocks(ids[first_blk:last_blk])
                groups.append((offset + skipped, window))
            chunks.append(
                ChunkLoad(
                    key=keys[idx] if idx < len(keys) else NOT_STORED,
                    first_block=groups[0][0],
                    block_ids=groups[0][1],
                    num_tokens=hi - lo,
                    groups=groups if len(groups) > 1 else None,
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
        if self.background:
            meta.finished_saves, self._finished_saves = self._finished_saves, []
            meta.preempted = list(getattr(scheduler_output, "preempted_req_ids", None) or ())
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
                state.block_ids = [list(g) for g in new_req.block_ids or ()]
                if state.first_computed is None:
                    state.first_computed = new_req.num_computed_tokens
            self._consider_saves(so, meta, planned, new_req.req_id, new_req.num_computed_tokens)

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if state is not None and new_blocks is not None:
                if req_id in cached.resumed_req_ids or len(state.block_ids) != len(new_blocks):
                    state.block_ids = [list(g) for g in new_blocks]
                else:
                    for ids, new in zip(state.block_ids, new_blocks, strict=True):
                        ids.extend(new)
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
        block_ids = self._block_ids_now(req_id, state)
        for idx in range(state.next_save_chunk, n_full):
            key = keys[idx]
            if (
                key in planned
                or key in self._inflight_saves
                or key in self._queued
                or self.files.stored(key)
            ):
                continue
            groups = [ids[idx * cb : (idx + 1) * cb] for ids in block_ids]
            if not groups or any(len(blocks) < cb for blocks in groups):
                break
            if not all(all_real(blocks) for blocks in groups):
                # A windowed group no longer holds (or never held: a hit behind the
                # window) some of the chunk's blocks: it cannot be stored whole.
                continue
            blocks = groups[0]
            if not self._admit(state, idx, key, len(prompt)):
                continue
            planned.add(key)
            self._inflight_saves[key] = self._step
            if self.background:
                self._saving_reqs.add(req_id)
                self._queued.add(key)
            meta.saves.append(
                SaveSpec(key=key, block_ids=list(blocks), num_tokens=self.chunk_tokens,
                         req_id=req_id, event=self._stored_event(state, idx),
                         groups=[list(b) for b in groups] if len(groups) > 1 else None)
            )  # fmt: skip
        state.next_save_chunk = n_full

    def _block_ids_now(self, req_id: str, state: _ReqState) -> list[list[int]]:
        """The request's block ids per group as vLLM holds them now: with a windowed group,
        read from the KV cache manager (its nulls are the blocks already freed), else as the
        scheduler output told them."""
        if self._manager is not None and any(self.groups.windowed):
            return [list(g) for g in self._manager.get_block_ids(req_id)]
        return state.block_ids

    def _admit(self, state: _ReqState, idx: int, key: str, prompt_len: int) -> bool:
        """Whether chunk ``idx`` (not stored here) may be saved; counted."""
        rule = self.admission.rule
        c = self.chunk_tokens
        if (
            rule.promote
            and state.local_hit is not None
            and state.first_computed is not None
            and idx * c >= state.local_hit
            and (idx + 1) * c <= state.first_computed
        ):
            self._count(promotions=1)
            return True
        if rule.everything:
            return True
        if state.selected is None:  # admit_when, judged once per request
            state.selected = self.admission.selects(state.request)
        ok = self.admission.admits(key, prompt_len, state.selected)
        self._count(**{"admits" if ok else "rejects": 1})
        return ok

    def _count(self, **counts: int) -> None:
        self.stats.add(**counts)
        self.total_stats.add(**counts)

    def _stored_event(self, state: _ReqState, idx: int) -> Any:
        """The ``BlockStored`` event the worker publishes once chunk ``idx`` is written."""
        if self.event_medium is None:
            return None
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        request = state.request
        cb = self.config.chunk_blocks
        hashes = list(getattr(request, "block_hashes", None) or ())
        first, last = idx * cb, (idx + 1) * cb
        if len(hashes) < last:
            return None
        lora = getattr(request, "lora_request", None)
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[first * self.block_size : last * self.block_size]),
            block_size=self.block_size,
            lora_id=lora.adapter_id if lora else None,
            medium=self.event_medium,
            lora_name=lora.name if lora else None,
        )

    # ---------------------------------------------------------------- bookkeeping

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # A request whose async load failed is not offered the store again (with the
        # "recompute" policy vLLM looks it up once more).
        failed = getattr(connector_output, "failed_recving", None) or ()
        self._no_store_reqs.update(failed)
        outcome = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(outcome, StoreWorkerMeta):
            self._queued -= outcome.written
            self._queued -= outcome.dropped
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, StoreKVEvents):
            self._events.extend(events.aggregate().get_all_events())

    def take_events(self) -> list[Any]:
        """The BlockStored events of chunks written since the last call."""
        out, self._events = self._events, []
        return out

    def interval_stats(self) -> PrefixStoreStats | None:
        """Admission counters since the last call (then reset), or None."""
        if self.stats.is_empty():
            return None
        out = PrefixStoreStats(data=self.stats.snapshot())
        self.stats.reset()
        return out

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Synchronous saves never hold its blocks; with background
        saves, a request that had saves planned keeps its blocks (``True``) until the
        worker reports it in ``finished_sending``, once its chunks are written."""
        req_id = request.request_id
        self._reqs.pop(req_id, None)
        self._lookup_local.pop(req_id, None)
        self._local_hit.pop(req_id, None)
        self._load_ranges.pop(req_id, None)
        self._no_store_reqs.discard(req_id)
        self._pending_loads.pop(req_id, None)
        if req_id in self._saving_reqs:
            self._saving_reqs.discard(req_id)
            self._finished_saves.append(req_id)
            return True, None
        return False, None

    def reset_cache(self) -> bool:
        """Delete every chunk file (``/reset_prefix_cache?reset_external``)."""
        if self.config.read_only:
            return False
        self.files.clear()
        self._inflight_saves.clear()
        self._queued.clear()
        return True
