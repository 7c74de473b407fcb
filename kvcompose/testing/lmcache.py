"""A test double of LMCache as a vLLM child connector, for machines where LMCache cannot run.

LMCache's GPU connector has no CPU implementation, so the real ``LMCacheConnectorV1`` cannot
store or load here. ``LMCacheDouble`` keeps LMCache's *contract with vLLM's scheduler* — what
its adapter promises, asserts and ignores — over a store of token chunks held in this
process, so kvcompose trees with LMCache in them run on vLLM's real scheduler.

Read from LMCache's vLLM adapter, ``LMCacheConnectorV1Impl`` in
``lmcache/integration/vllm/vllm_v1_adapter.py`` (LMCache/LMCache at e23f2bbc; vLLM vendors
the same code as ``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_integration/
vllm_v1_adapter.py``, identical in vLLM 0.32 and 0.33), and vLLM's wrapper
``LMCacheConnectorV1`` (``.../v1/lmcache_connector.py``); the methods named are
``LMCacheConnectorV1Impl``'s unless said:

- **lookup** (``get_num_new_matched_tokens``): the hit is the longest stored prefix of the
  prompt, in whole chunks of ``chunk_size`` tokens (256 by default; a last partial chunk
  only with ``save_unfull_chunk``); it promises ``hit - num_computed_tokens``, one less when
  the whole prompt hit ("we need to recompute the last token"), 0 when that is not
  positive, ``None`` while an async lookup is not done; it remembers ``LoadSpec(vllm_cached=
  num_computed_tokens, lmcache_cached=hit, can_load=False)``. vLLM's wrapper always answers
  synchronous: ``(n, False)`` (``LMCacheConnectorV1.get_num_new_matched_tokens``).
- **allocation** (``update_state_after_alloc``): without a remembered lookup it does
  nothing; ``num_external_tokens == 0`` cancels the load (``can_load = False``); otherwise,
  unless the whole prompt hit, it *asserts* that the count equals what it promised
  (``"Mismatch in number of tokens"``), then ``can_load = True``.
- **metadata** (``build_connector_meta``): loads only for requests scheduled *new* in this
  step (its loop over ``scheduled_new_reqs`` pops the spec); saves in whole chunks (the
  partial last chunk only at the end of the prefill with ``save_unfull_chunk``), skipping
  what it already holds (``ReqMeta.from_request_tracker``).
- **worker**: ``start_load_kv`` retrieves synchronously, in the step (non-layerwise);
  ``wait_for_save`` stores synchronously; ``get_finished`` reports nothing, ever: LMCache
  never loads asynchronously and never delays a free (``request_finished`` returns
  ``False``).
- **class facts**: no ``SupportsHMA`` (``class LMCacheConnectorV1(KVConnectorBase_V1)``),
  no required KV-cache layout (the base's ``None``), piecewise CUDA graphs only with
  ``use_layerwise`` (``LMCacheConnectorV1.requires_piecewise_for_cudagraph``).

The double raises ``LMCacheContractError`` where LMCache would assert, and records the rest
in its ``Cache`` (``kv_connector_extra_config: {"cache": NAME}``; both roles find it in the
process-wide ``CACHES``): lookups, promises, cancellations, loads, stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

DEFAULT_CHUNK_SIZE = 256  # LMCacheEngineConfig's default chunk_size


class LMCacheContractError(AssertionError):
    """Where the real LMCache adapter's ``assert`` would fire."""


@dataclass
class LoadSpec:
    vllm_cached_tokens: int
    lmcache_cached_tokens: int
    can_load: bool = False


@dataclass
class Cache:
    """What one LMCache instance holds (chunk prefixes) and what it was asked and did."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    save_unfull_chunk: bool = False
    prefixes: set[tuple[int, ...]] = field(default_factory=set)
    events: list[tuple[Any, ...]] = field(default_factory=list)

    def hit(self, tokens: list[int]) -> int:
        """The longest stored prefix of ``tokens``, in whole chunks (or the whole prompt
        when a partial last chunk was stored)."""
        best = 0
        for end in range(self.chunk_size, len(tokens) + 1, self.chunk_size):
            if tuple(tokens[:end]) not in self.prefixes:
                return best
            best = end
        if self.save_unfull_chunk and tuple(tokens) in self.prefixes:
            return len(tokens)
        return best

    def store(self, tokens: list[int], *, last_prefill: bool) -> int:
        """Store the chunks of ``tokens`` (and the partial tail at the end of the prefill
        with ``save_unfull_chunk``); returns how many tokens are held for them."""
        end = len(tokens) // self.chunk_size * self.chunk_size
        for stop in range(self.chunk_size, end + 1, self.chunk_size):
            self.prefixes.add(tuple(tokens[:stop]))
        if last_prefill and self.save_unfull_chunk and len(tokens) > end:
            self.prefixes.add(tuple(tokens))
            end = len(tokens)
        return end

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == kind]


#: Every double's cache, by name (``kv_connector_extra_config["cache"]``).
CACHES: dict[str, Cache] = {}


def cache(name: str, **fields: Any) -> Cache:
    """A fresh cache under ``name`` (replacing any earlier one)."""
    CACHES[name] = Cache(**fields)
    return CACHES[name]


def lmcache_leaf(name: str, cache_name: str | None = None, **fields: Any) -> dict[str, Any]:
    """A kvcompose tree leaf running the double over ``CACHES[cache_name or name]``."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "LMCacheDouble",
        "module_path": __name__,
        "extra_config": {"cache": cache_name or name},
        **fields,
    }


@dataclass
class _Load:
    req_id: str
    tokens: list[int]
    vllm_cached_tokens: int
    lmcache_cached_tokens: int


@dataclass
class _Save:
    req_id: str
    tokens: list[int]
    last_prefill: bool


@dataclass
class LMCacheDoubleMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)


class LMCacheDouble(KVConnectorBase_V1):
    """LMCache's scheduler contract over an in-process chunk store (see the module doc)."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(extra_config.get("use_layerwise", False))

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        name = ktc.get_from_extra_config("cache", "lmcache")
        self.cache = CACHES.setdefault(name, Cache())
        self._consumer = ktc.kv_role == "kv_consumer"  # LMCache does not save on kv_consumer
        self._load_specs: dict[str, LoadSpec] = {}
        self._prompts: dict[str, list[int]] = {}  # scheduled requests, until finished
        self._saved: dict[str, int] = {}  # tokens held per request (skip on the next save)

    # ------------------------------------------------------------------ scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        hit = self.cache.hit(tokens)
        need = hit - num_computed_tokens
        if hit == request.num_tokens:
            need -= 1  # the whole prompt hit: vLLM computes the last token
        self._load_specs[request.request_id] = LoadSpec(num_computed_tokens, hit)
        promised = max(need, 0)
        self.cache.events.append(("lookup", request.request_id, num_computed_tokens, promised))
        return promised, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        spec = self._load_specs.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens == 0:
            spec.can_load = False
            self.cache.events.append(("cancel", request.request_id))
            return
        promised = spec.lmcache_cached_tokens - spec.vllm_cached_tokens
        if spec.lmcache_cached_tokens != request.num_tokens and num_external_tokens != promised:
            raise LMCacheContractError(
                f"Mismatch in number of tokens: {num_external_tokens} vs "
                f"{spec.lmcache_cached_tokens} - {spec.vllm_cached_tokens} "
                f"for request {request.request_id}"
            )
        spec.can_load = True
        self.cache.events.append(("alloc", request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LMCacheDoubleMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self._prompts.pop(req_id, None)
            self._saved.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._load_specs.pop(new.req_id, None)  # loads only for new requests
            prompt = list(new.prompt_token_ids or [])
            self._prompts[new.req_id] = prompt
            if spec is not None and spec.can_load:
                meta.loads.append(
                    _Load(
                        new.req_id,
                        prompt[: spec.lmcache_cached_tokens],
                        spec.vllm_cached_tokens,
                        spec.lmcache_cached_tokens,
                    )
                )
            self._saved[new.req_id] = spec.lmcache_cached_tokens if spec is not None else 0
            self._plan_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._prompts:
                self._plan_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(
        self, meta: LMCacheDoubleMetadata, req_id: str, computed: int, so: SchedulerOutput
    ) -> None:
        """Prompt chunks computed by the end of this step and not held yet (decode tokens
        are not saved: ``save_decode_cache`` is off by default)."""
        if self._consumer:
            return
        prompt = self._prompts[req_id]
        done = min(computed + so.num_scheduled_tokens.get(req_id, 0), len(prompt))
        last = done == len(prompt)
        held = self._saved.get(req_id, 0)
        chunk = self.cache.chunk_size
        if done <= held or (not last and done // chunk * chunk <= held):
            return
        meta.saves.append(_Save(req_id, prompt[:done], last))
        self._saved[req_id] = done

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None  # LMCache never delays a free

    # --------------------------------------------------------------------- worker
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheDoubleMetadata)
        for load in meta.loads:  # synchronously, in the step
            held = self.cache.hit(load.tokens)
            if held < load.lmcache_cached_tokens:
                raise LMCacheContractError(
                    f"request {load.req_id}: promised {load.lmcache_cached_tokens} tokens, "
                    f"the cache holds {held}"
                )
            self.cache.events.append(
                ("load", load.req_id, load.lmcache_cached_tokens - load.vllm_cached_tokens)
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # non-layerwise: everything is stored in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheDoubleMetadata)
        for save in meta.saves:
            held = self.cache.store(save.tokens, last_prefill=save.last_prefill)
            self.cache.events.append(("store", save.req_id, held))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # no async loads, no delayed frees


__all__ = [
    "CACHES",
    "DEFAULT_CHUNK_SIZE",
    "Cache",
    "LMCacheContractError",
    "LMCacheDouble",
    "cache",
    "lmcache_leaf",
]
