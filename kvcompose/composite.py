"""``CompositeConnector``: one node of a kvcompose tree, and itself a vLLM connector.

The node forwards every member of vLLM's ``KVConnectorBase_V1`` to its children by the rule
written for it in ``kvcompose.rules`` (the drift test checks the two stay in step). What makes
chain, fan-out and route differ is only the lookup policy (``kvcompose.policies``); what every
node shares lives here:

- the ownership **ledger** (scheduler side): who owns each request's load;
- the contract **guard**: normalises and counts what children return;
- the worker-side **signal filter**: one terminal signal per request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
    supports_hma,
)

from kvcompose import tree as specs
from kvcompose.children import Child, build_child, child_class, child_vllm_config
from kvcompose.guard import Guard
from kvcompose.ledger import Ledger, LoadState
from kvcompose.metadata import (
    ComposedHandshake,
    ComposedKVEvents,
    ComposedWorkerMeta,
    CompositeMetadata,
)
from kvcompose.policies import RoutePolicy, policy_for
from kvcompose.signals import WorkerSignals
from kvcompose.stats import ComposedStats, NodeCounters, build_composed_prom_metrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvcompose")

T = TypeVar("T")


class CompositeConnector(KVConnectorBase_V1):
    """A chain, fan-out or route node. Subclasses only choose how the tree is read
    (``tree_from_config``) and whether the class supports HMA."""

    # ------------------------------------------------------------------ building
    @classmethod
    def tree_from_config(cls, extra_config: Mapping[str, Any]) -> specs.Composite:
        """The node's spec, read from its ``kv_connector_extra_config``."""
        if specs.TREE_KEY in extra_config:  # a subtree handed down by a parent composite
            tree = specs.parse_node(extra_config[specs.TREE_KEY])
        else:
            from kvcompose.config import tree_from_extra_config

            tree = tree_from_extra_config(extra_config)
        if isinstance(tree, specs.Leaf):  # a lone connector: a chain of one
            tree = specs.Chain(name="root", children=(tree,))
        return tree

    @staticmethod
    def strict_from_config(extra_config: Mapping[str, Any]) -> bool:
        import os

        return bool(extra_config.get("strict")) or os.environ.get("KVCOMPOSE_STRICT") == "1"

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.spec = self.tree_from_config(extra)
        self.name = self.spec.name
        self.strict = self.strict_from_config(extra)
        self.children: list[Child] = [
            build_child(vllm_config, role, kv_cache_config, child, strict=self.strict)
            for child in self.spec.children]
        # vLLM's SimpleCPUOffload discovery duck-types on ``_connectors``.
        self._connectors = [c.connector for c in self.children]
        self.policy = policy_for(self.spec)
        self._longest = self.policy.mode == "longest"
        self._fixed_candidates = (None if isinstance(self.policy, RoutePolicy)
                                  else self.policy.candidates(None))  # type: ignore[arg-type]
        self._debug = logger.isEnabledFor(logging.DEBUG)  # refreshed every step
        self.refresh_child_methods()
        self._divergent_hits = bool(self._connectors) and all(
            c.supports_divergent_local_hybrid_hits for c in self._connectors)
        self.counters = NodeCounters([c.name for c in self.children])
        self.guard = Guard(self.name, [c.name for c in self.children], strict=self.strict,
                           on_error=[c.spec.on_error for c in self.children],
                           count=self.counters.inc)
        self._lookup_timeout_s = self.spec.lookup_timeout_s
        # scheduler side
        self.ledger = Ledger()
        self._block_size = vllm_config.cache_config.block_size
        self._step_loads: dict[str, int] = {}
        self._step_sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._step_sends: dict[str, tuple[int, ...]] = {}
        self._partial_tails: dict[str, set[int]] = {}
        self._send_children: dict[str, tuple[int, ...]] = {}  # until finished_sending
        self._recv_after_finish: dict[str, int] = {}  # aborted loads, until finished_recving
        # finished while loading with a delaying child: "waiting" / "received" / "sent"
        self._send_after_recv: dict[str, str] = {}
        # worker side
        self.signals = WorkerSignals(self.guard)
        if role is KVConnectorRole.SCHEDULER:
            self.get_finished_count()  # refuse to start on a conflict

    def refresh_child_methods(self) -> None:
        """Cache the children's bound methods used on the per-request hot paths. Call again
        after replacing a method on a child instance (tracing, fault injection)."""
        self._lookups = [c.get_num_new_matched_tokens for c in self._connectors]
        self._allocs = [c.update_state_after_alloc for c in self._connectors]
        self._new_request = [c.on_new_request for c in self._connectors]
        self._finishers = [c.request_finished for c in self._connectors]

    # ------------------------------------------------------------ introspection
    def live_requests(self) -> dict[str, Any]:
        """Every per-request table of this node and its composite descendants that still
        holds something; ``{}`` when nothing is in flight (the leak check)."""
        tables: dict[str, Any] = {}
        if len(self.ledger):
            tables["ledger"] = self.ledger.snapshot()
        if self._partial_tails:
            tables["partial_tails"] = {k: sorted(v) for k, v in self._partial_tails.items()}
        if self._send_children:
            tables["sends_pending"] = dict(self._send_children)
        if self._recv_after_finish:
            tables["aborted_loads_pending"] = dict(self._recv_after_finish)
        if self._send_after_recv:
            tables["send_after_recv"] = dict(self._send_after_recv)
        tables.update(self.signals.live())
        for child in self.children:
            live = getattr(child.connector, "live_requests", None)
            if isinstance(child.connector, CompositeConnector) and live is not None:
                nested = live()
                if nested:
                    tables[child.name] = nested
        return tables

    def stats_totals(self) -> dict[str, Any]:
        """Counters since start for this node and its composite descendants:
        ``{"node": name, "counters": {...}, "children": {name: {...}}}``."""
        nested = {c.name: c.connector.stats_totals() for c in self.children
                  if isinstance(c.connector, CompositeConnector)}
        return {"node": self.name, "counters": dict(self.counters.totals), "children": nested}

    def ownership(self) -> dict[str, dict[str, object]]:
        """The live ownership table: request id → state, owner (child name), tokens, reason."""
        table = self.ledger.snapshot()
        for record in table.values():
            owner = record["owner"]
            record["owner"] = None if owner is None else self.children[owner].name  # type: ignore[index]
        return table

    # ------------------------------------------------------------- rule helpers
    # Errors: ``_all`` lets a child's exception through (set-up and bookkeeping calls a
    # child cannot work without); the others contain it by the child's ``on_error`` policy.
    def _all(self, method: str, *args: Any, **kwargs: Any) -> None:
        for child in self._connectors:
            getattr(child, method)(*args, **kwargs)

    def _call(self, child: int, method: str, default: T, *args: Any, **kwargs: Any) -> T:
        try:
            return getattr(self._connectors[child], method)(*args, **kwargs)
        except Exception as exc:
            self.guard.child_error(child, method, exc)  # re-raises under on_error: fail
            return default

    def _all_loading(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Worker calls that load KV: a child that raises fails its own loads, no other's."""
        for i, child in enumerate(self._connectors):
            try:
                getattr(child, method)(*args, **kwargs)
            except Exception as exc:
                self.signals.fail_loads_of(i)
                self.guard.child_error(i, method, exc)

    def _savers_all(self, method: str, *args: Any, **kwargs: Any) -> None:
        for i, child in enumerate(self.children):
            if child.saves:
                self._call(i, method, None, *args, **kwargs)

    def _any(self, method: str) -> bool:
        return any(self._call(i, method, False) for i in range(len(self._connectors)))

    # ======================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        # The scheduler calls this for every waiting request every step: keep it lean.
        req_id = request.request_id
        record = self.ledger.get(req_id)
        if record is None:
            timed_out, excluded = False, frozenset()
        else:
            timed_out = (record.state is LoadState.PENDING and record.pending_since is not None
                         and time.monotonic() - record.pending_since >= self._lookup_timeout_s)
            excluded = record.excluded
        candidates = self._fixed_candidates or self.policy.candidates(request)
        longest = self._longest
        # what each child answered, kept only for the debug decision record
        trace: list[str] | None = [] if self._debug else None
        best: tuple[int, int, bool] | None = None  # (child, tokens, async)
        pending = False
        timeouts: list[int] = []
        disabled = self.guard.disabled
        for child in candidates.children:
            if child in disabled:
                continue
            if child in excluded:
                if trace is not None:
                    trace.append(f"{self.children[child].name}=excluded(failed)")
                continue
            try:
                result = self._lookups[child](request, num_computed_tokens)
            except Exception as exc:
                self.guard.child_error(child, "get_num_new_matched_tokens", exc)
                result = (0, False)
            if (type(result) is tuple and len(result) == 2 and type(result[0]) is int
                    and (result[0] > 0 or not result[1])):
                tokens, is_async = result  # well formed: the common case, checked inline
            else:
                tokens, is_async = self.guard.normalise_lookup(child, result)
            if trace is not None:
                trace.append(f"{self.children[child].name}="
                             f"{tokens}{'a' if is_async and tokens else ''}")
            if tokens is None:
                if timed_out:
                    timeouts.append(child)
                    continue
                pending = True
                if longest:
                    continue
                break
            if tokens > 0 and (best is None or tokens > best[1]):
                best = (child, tokens, is_async)
                if not longest:
                    break
        if pending:
            self.ledger.mark_pending(req_id, time.monotonic())
            return None, False
        for child in timeouts:
            self.counters.lookup_timeout(child)
        self.counters.lookup()
        reason = candidates.reason
        if timeouts:
            reason += "+deadline"
        if excluded:
            reason += "+fallback"
        owner, tokens, is_async = best if best is not None else (None, 0, False)
        if owner is not None or record is not None:  # a plain miss needs no record
            self.ledger.decide(req_id, owner, tokens, is_async, reason, num_computed_tokens)
        if owner is not None:
            self.counters.hit(owner, tokens)
        if trace is not None:
            logger.debug("kvcompose[%s] %s: asked [%s] → owner %s, %d tokens%s, by %s",
                         self.name, request.request_id, ", ".join(trace),
                         "none" if owner is None else self.children[owner].name, tokens,
                         " async" if is_async else "", reason)
        return tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        record = self.ledger.allocated(req_id, num_external_tokens)
        owner = record.owner if record is not None else None
        for i, alloc in enumerate(self._allocs):
            n = num_external_tokens if i == owner else 0
            try:
                alloc(request, blocks, n)
            except Exception as exc:
                if n > 0:
                    raise  # the scheduler already counts these tokens: a load must happen
                self.guard.child_error(i, "update_state_after_alloc", exc)
        if num_external_tokens > 0 and record is not None and owner is not None:
            record.load_blocks = self._load_blocks(blocks, record.local_tokens,
                                                   num_external_tokens)
            if record.state is LoadState.LOADING:
                self._step_loads[req_id] = owner
            elif record.state is LoadState.LOADED:
                self._step_sync_loads[req_id] = (owner, record.load_blocks)

    def _load_blocks(self, blocks: KVCacheBlocks, local_tokens: int, n: int
                     ) -> tuple[int, ...]:
        """The block ids a load of ``n`` tokens after ``local_tokens`` writes (group 0)."""
        block_size = self._block_size
        first = local_tokens // block_size
        last = -(-(local_tokens + n) // block_size)
        return tuple(blocks.get_block_ids()[0][first:last])

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[Any, int]:
        owner = self.ledger.owner(request.request_id)
        default = super().get_external_cache_hit_sources(request, num_external_tokens)
        if owner is None:
            return default
        return self._call(owner, "get_external_cache_hit_sources", default, request,
                          num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        owner = self.ledger.owner(request.request_id)
        if owner is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self._connectors[owner].get_loaded_kv_cache_group_ids(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._debug = logger.isEnabledFor(logging.DEBUG)
        children = tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
        metadata = CompositeMetadata(children, self._step_loads, self._step_sync_loads,
                                     self._step_sends)
        self._step_loads, self._step_sync_loads, self._step_sends = {}, {}, {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the step's output as if it were the only connector: receives and
        failures of the loads it owns, sends of the requests it delayed, its own worker
        metadata and KV events (upstream hands every child everything, so a child that
        tracks its failures blames itself for another child's failed load)."""
        recv = connector_output.finished_recving or set()
        failed = connector_output.failed_recving or set()
        sent = connector_output.finished_sending or set()
        if connector_output.invalid_block_ids:
            self.ledger.exclude_owners_of_blocks(connector_output.invalid_block_ids)
        worker_meta = connector_output.kv_connector_worker_meta
        events = connector_output.kv_cache_events
        if not (recv or failed or sent or worker_meta or events):
            for i in range(len(self._connectors)):  # nothing to attribute: one shared view
                self._call(i, "update_connector_output", None, connector_output)
            return
        recv_by: dict[int, set[str]] = {}
        for req_id in recv | failed:
            owner = self.ledger.owner(req_id)
            if owner is None:
                owner = self._recv_after_finish.pop(req_id, None)
            self.ledger.recv_finished(req_id, failed=req_id in failed)
            if owner is not None:
                recv_by.setdefault(owner, set()).add(req_id)
        sent_by: dict[int, set[str]] = {}
        for req_id in sent:
            for child in self._send_children.pop(req_id, ()):
                sent_by.setdefault(child, set()).add(req_id)
        for i in range(len(self._connectors)):
            mine = recv_by.get(i, set())
            self._call(i, "update_connector_output", None, dataclasses.replace(
                connector_output,
                finished_recving=mine or None,
                failed_recving=mine & failed,
                finished_sending=sent_by.get(i) or None,
                kv_connector_worker_meta=(worker_meta.children[i]
                                          if isinstance(worker_meta, ComposedWorkerMeta)
                                          else None),
                kv_cache_events=(events.children[i] if isinstance(events, ComposedKVEvents)
                                 else None)))
        if self._send_after_recv and (recv or sent):
            self._one_terminal_signal(connector_output, recv, sent)

    def _one_terminal_signal(self, connector_output: KVConnectorOutput, recv: set[str],
                             sent: set[str]) -> None:
        """A request that finished while its async load was in flight *and* had a child
        delay its free would get two terminal signals: the owner's ``finished_recving`` and
        the delayers' ``finished_sending``. vLLM frees the request on the first and asserts
        on the second, and a send arriving first would free blocks still being loaded into.
        So the receive is swallowed and the send held until both happened; vLLM then sees one
        ``finished_sending``. This runs before the scheduler reads the sets (contract §1.3).
        """
        for req_id in recv & self._send_after_recv.keys():
            connector_output.finished_recving.discard(req_id)  # type: ignore[union-attr]
            connector_output.failed_recving.discard(req_id)
            if self._send_after_recv[req_id] == "sent":
                del self._send_after_recv[req_id]
                connector_output.finished_sending = (connector_output.finished_sending
                                                     or set()) | {req_id}
            else:
                self._send_after_recv[req_id] = "received"
        for req_id in sent & self._send_after_recv.keys():
            if self._send_after_recv[req_id] == "received":
                del self._send_after_recv[req_id]
            else:
                self._send_after_recv[req_id] = "sent"
                connector_output.finished_sending.discard(req_id)  # type: ignore[union-attr]

    def register_finished_partial_tail(self, request: Request, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]) -> bool:
        accepted = {i for i in range(len(self._connectors))
                    if self._call(i, "register_finished_partial_tail", False, request,
                                  block_ids, partial_tail_offloads)}
        if accepted:
            self._partial_tails[request.request_id] = accepted
        return bool(accepted)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._finish(request, block_ids, self._finishers)

    def _finish(self, request: Request, block_ids: Any,
                finishers: list[Callable[[Request, Any], tuple[bool, dict[str, Any] | None]]]
                ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        delaying = self._partial_tails.pop(req_id, None)
        merged: dict[str, Any] | None = None
        producer: dict[str, int] = {}
        first_error: BaseException | None = None
        for i, finish in enumerate(finishers):
            try:
                delay, params = finish(request, block_ids)
            except Exception as exc:  # every child must still hear the finish
                try:
                    self.guard.child_error(i, "request_finished", exc)
                except Exception as fatal:
                    first_error = first_error or fatal
                continue
            if delay:
                if delaying is None:
                    delaying = set()
                delaying.add(i)
            if params:
                merged = self._merge_params(merged, params, producer, i, req_id)
        record = self.ledger.finished(req_id)
        if record is not None and record.state is LoadState.LOADING:
            # aborted while loading: the owner's receive still comes, and is the owner's
            self._recv_after_finish[req_id] = record.owner  # type: ignore[assignment]
        if first_error is not None:
            raise first_error
        if delaying:
            self._step_sends[req_id] = self._send_children[req_id] = tuple(sorted(delaying))
            if record is not None and record.state is LoadState.LOADING:
                self._send_after_recv[req_id] = "waiting"
        return bool(delaying), merged

    def _merge_params(self, merged: dict[str, Any] | None, params: dict[str, Any],
                      producer: dict[str, int], child: int, req_id: str) -> dict[str, Any]:
        merged = {} if merged is None else merged
        for key, value in params.items():
            if key in producer and merged[key] != value:
                other = self.children[producer[key]].name
                self.guard.violation(child, "params_clash",
                                     f"kv_transfer_params key {key!r} for {req_id} also set "
                                     f"by {other!r}; keeping {other!r}'s value")
                continue
            producer.setdefault(key, child)
            merged.setdefault(key, value)
        return merged

    def on_new_request(self, request: Request) -> None:
        for i, new_request in enumerate(self._new_request):
            try:
                new_request(request)
            except Exception as exc:
                self.guard.child_error(i, "on_new_request", exc)

    def take_events(self) -> Iterable[KVCacheEvent]:
        for i in range(len(self._connectors)):
            yield from self._call(i, "take_events", ())

    def has_pending_block_frees(self) -> bool:
        return self._any("has_pending_block_frees")

    def has_pending_push_work(self) -> bool:
        return self._any("has_pending_push_work")

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._all("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._all("bind_gpu_block_pool", gpu_block_pool)

    def get_finished_count(self) -> int | None:
        world_size = self._vllm_config.parallel_config.world_size
        counts = {child.name: child.connector.get_finished_count() for child in self.children}
        resolved = {name: world_size if c is None else c for name, c in counts.items()}
        if len(set(resolved.values())) > 1:
            raise ValueError(
                f"kvcompose[{self.name}]: children expect different numbers of finished "
                f"signals per request ({resolved}; None = world size {world_size}); vLLM has "
                "one count for all requests, so these connectors cannot share a composite")
        value = next(iter(resolved.values()), world_size)
        return None if value == world_size else value

    def reset_cache(self) -> bool | None:
        results = [self._call(i, "reset_cache", False) for i in range(len(self._connectors))]
        if any(r is False for r in results):
            return False
        if results and all(r is True for r in results):
            return True
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        for i, child in enumerate(self._connectors):
            part = {k: md.children[i] for k, md in metadata.items()
                    if isinstance(md, ComposedHandshake) and md.children[i] is not None}
            if part:
                child.set_xfer_handshake_metadata(part)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        for i, child in enumerate(self._connectors):
            part = {k: md.children[i] for k, md in metadata.items()
                    if isinstance(md, ComposedHandshake) and md.children[i] is not None}
            if part:
                child.set_xfer_handshake_metadata_pp_aware(part)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._divergent_hits  # read per lookup: taken from the children once

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self._connectors)

    # =========================================================== worker side
    def get_mem_pool_context(self) -> AbstractContextManager | None:
        contexts = [(c.name, ctx) for c in self.children
                    if (ctx := c.connector.get_mem_pool_context()) is not None]
        if len(contexts) > 1:
            raise ValueError(f"kvcompose[{self.name}]: children {[n for n, _ in contexts]} each "
                             "want their own KV-cache memory pool; at most one can")
        return contexts[0][1] if contexts else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._all("register_kv_caches", kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._all("set_host_xfer_buffer_ops", copy_operation)

    def unregister_kv_caches(self) -> None:
        self._all("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self._all("restore_kv_caches")

    def finish_forward(self) -> None:
        self._all("finish_forward")

    def reset_capture_state(self) -> None:
        self._all("reset_capture_state")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, CompositeMetadata)
        for child, md in zip(self._connectors, kv_connector_metadata.children, strict=True):
            if md is not None:
                child.handle_preemptions(md)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, CompositeMetadata)
        super().bind_connector_metadata(connector_metadata)
        self.signals.on_metadata(connector_metadata)
        for child, md in zip(self._connectors, connector_metadata.children, strict=True):
            if md is not None:
                child.bind_connector_metadata(md)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._all("clear_connector_metadata")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._all_loading("start_load_kv", forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._all_loading("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._savers_all("save_kv_layer", layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._savers_all("wait_for_save")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = []
        for i, child in enumerate(self._connectors):
            try:
                results.append(child.get_transfer_results(finished_req_ids))
            except Exception as exc:
                self.signals.fail_loads_of(i)
                self.guard.child_error(i, "get_transfer_results", exc)
                results.append(None)
        return self.signals.combine(results)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set()
        for i, child in enumerate(self._connectors):
            try:
                errors |= child.get_block_ids_with_load_errors()
            except Exception as exc:
                self.signals.fail_loads_of(i)
                self.guard.child_error(i, "get_block_ids_with_load_errors", exc)
        return errors | self.signals.take_failed_blocks()

    def get_kv_connector_kv_cache_events(self) -> ComposedKVEvents | None:
        events = [self._call(i, "get_kv_connector_kv_cache_events", None)
                  for i in range(len(self._connectors))]
        return None if all(e is None for e in events) else ComposedKVEvents(events)

    def get_handshake_metadata(self) -> ComposedHandshake | None:
        parts = tuple(c.get_handshake_metadata() for c in self._connectors)
        return None if all(p is None for p in parts) else ComposedHandshake(parts)

    def build_connector_worker_meta(self) -> ComposedWorkerMeta | None:
        parts = tuple(self._call(i, "build_connector_worker_meta", None)
                      for i in range(len(self._connectors)))
        return None if all(p is None for p in parts) else ComposedWorkerMeta(parts)

    # ============================================================= both sides
    def get_kv_connector_stats(self) -> ComposedStats | None:
        stats = ComposedStats.collect(self)
        return None if stats is None or stats.is_empty() else stats

    def shutdown(self) -> None:
        first_error: BaseException | None = None
        for child in self.children:
            try:
                child.connector.shutdown()
            except Exception as exc:
                logger.error("kvcompose[%s]: child %r failed to shut down: %s", self.name,
                             child.name, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    # ============================================================ class level
    @classmethod
    def _child_classes(cls, vllm_config: VllmConfig) -> list[tuple[type[KVConnectorBase_V1],
                                                                   VllmConfig]]:
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
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if vllm_config.kv_transfer_config is None:
            return None
        layouts = {}
        for child_cls, config in cls._child_classes(vllm_config):
            layout = child_cls.get_required_kvcache_layout(config)
            if layout is not None:
                layouts[child_cls.__name__] = layout
        if len(set(layouts.values())) > 1:
            raise ValueError(f"kvcompose: children require different KV-cache layouts: "
                             f"{layouts}; they cannot share one KV cache")
        return next(iter(layouts.values()), None)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        tree = cls.tree_from_config(extra_config)
        for child in tree.children:
            if isinstance(child, specs.Leaf):
                child_cls = _leaf_class(child)
                if child_cls.requires_piecewise_for_cudagraph(dict(child.extra_config)):
                    return True
            elif cls.requires_piecewise_for_cudagraph({specs.TREE_KEY: specs.dump_node(child)}):
                return True
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        tree = cls.tree_from_config(kv_transfer_config.kv_connector_extra_config)
        from vllm.config import KVTransferConfig

        from kvcompose.children import child_transfer_dict

        for child in tree.children:
            ktc = KVTransferConfig(**child_transfer_dict(kv_transfer_config, child, strict=False,
                                                         hma=False))
            child_cls = _leaf_class(child) if isinstance(child, specs.Leaf) else cls
            check = getattr(child_cls, "supports_sleep_mode", None)
            if check is not None and not check(ktc):
                return False
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ComposedStats:
        return ComposedStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> Any:
        return build_composed_prom_metrics(cls, vllm_config, metric_types, labelnames,
                                           per_engine_labelvalues)


class CompositeConnectorHMA(CompositeConnector, SupportsHMA):
    """The same node for the hybrid KV cache manager: vLLM decides HMA support per class."""

    def refresh_child_methods(self) -> None:
        super().refresh_child_methods()
        self._finishers_all_groups = [
            child.request_finished_all_groups if supports_hma(child)  # type: ignore[attr-defined]
            else self._one_group(child) for child in self._connectors]

    def _one_group(self, child: KVConnectorBase_V1
                   ) -> Callable[[Request, tuple[list[int], ...]], tuple[bool, Any]]:
        def finish(request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
            if len(block_ids) != 1:
                raise ValueError(f"kvcompose[{self.name}]: {type(child).__name__} does not "
                                 f"support HMA but the request has {len(block_ids)} KV groups")
            return child.request_finished(request, block_ids[0])

        return finish

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finish(request, block_ids, self._finishers_all_groups)


def _leaf_class(leaf: specs.Leaf) -> type[KVConnectorBase_V1]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    class _Ktc:  # what get_connector_class reads
        kv_connector = leaf.connector
        kv_connector_module_path = leaf.module_path

    return KVConnectorFactory.get_connector_class(_Ktc)  # type: ignore[arg-type, return-value]
