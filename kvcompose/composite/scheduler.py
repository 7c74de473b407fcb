"""The scheduler half of a composite node: who loads each request, and when it is done.

It holds the node's lookup policy, the load ledger and the finish records
(``kvcompose.composite.ledger``), and what one step hands to the worker half: the async loads
given out (owner per request), the sync loads (owner and blocks), and the requests whose
free waits for children's sends (``CompositeMetadata``). What each child is shown of a step's
output is ``kvcompose.composite.output_routing``'s job; a stitched load's is
``kvcompose.composite.stitch``'s.

vLLM's scheduler calls ``get_num_new_matched_tokens`` for every waiting request every step,
and ``update_state_after_alloc`` / ``request_finished`` once or twice per request: those paths
call the children through bound methods cached by ``refresh_child_methods`` and check the
common well-formed answers inline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

from kvcompose import tree as nodes
from kvcompose.composite import stitch
from kvcompose.composite.children import Children
from kvcompose.composite.forwarding import SchedulerForwarding
from kvcompose.composite.ledger import Finishes, Ledger, LoadState
from kvcompose.composite.metadata import CompositeMetadata, StitchLoad
from kvcompose.composite.output_routing import OutputRouter
from kvcompose.composite.policies import RouteLookup, policy_for
from kvcompose.composite.stats import NodeCounters

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvcompose")

Finisher = Callable[["Request", Any], tuple[bool, dict[str, Any] | None]]


class CompositeScheduler(SchedulerForwarding):
    """Scheduler-side state and methods of one node (built for the SCHEDULER role).

    ``base_hit_sources`` and ``base_group_ids`` are vLLM's defaults for a request without an
    owner (the node's own ``KVConnectorBase_V1`` implementations)."""

    def __init__(
        self,
        name: str,
        tree: nodes.Composite,
        children: Children,
        counters: NodeCounters,
        vllm_config: VllmConfig,
        *,
        base_hit_sources: Callable[[Request, int], dict[Any, int]],
        base_group_ids: Callable[[Request], tuple[int, ...]],
        ask_every_child: bool = False,
        num_kv_groups: int = 1,
    ) -> None:
        super().__init__(name, children, vllm_config.parallel_config.world_size)
        self.counters = counters
        self.policy = policy_for(tree)
        self._longest = self.policy.mode == "longest"
        # ``first`` stops at the first hit unless every child must be asked (vLLM's
        # MultiConnector does: a child that pins or prefetches on lookup relies on it);
        # the first hit still owns either way.
        self._stop_at_hit = not (self._longest or ask_every_child)
        # chain and fan-out ask the same children for every request
        fixed = not isinstance(self.policy, RouteLookup)
        self._fixed_candidates = self.policy.candidates(None) if fixed else None  # type: ignore[arg-type]
        self._lookup_timeout_s = tree.lookup_timeout_s
        self.debug = logger.isEnabledFor(logging.DEBUG)  # refreshed every step
        self.block_size = vllm_config.cache_config.block_size
        self._stitching = self.policy.mode == "stitch"
        self.range_supports = stitch.child_range_supports(tree)
        # vLLM refuses invalid block ids on models with several KV cache groups
        self._block_level_failures = num_kv_groups <= 1
        self.base_hit_sources = base_hit_sources
        self._base_group_ids = base_group_ids
        connectors = children.connectors
        self.divergent_hits = bool(connectors) and all(
            c.supports_divergent_local_hybrid_hits for c in connectors
        )
        self.ledger = Ledger()
        self.finishes = Finishes()
        self._outputs = OutputRouter(self.ledger, self.finishes, children)
        self._partial_tails: dict[str, set[int]] = {}  # accepted tails, until the finish
        self._step_loads: dict[str, int] = {}
        self._step_sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._step_sends: dict[str, tuple[int, ...]] = {}
        self.step_stitches: dict[str, StitchLoad] = {}
        self.step_sync_segments: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {}
        self.refresh_child_methods()

    def refresh_child_methods(self) -> None:
        """Cache the children's bound methods used on the per-request hot paths. Call again
        after replacing a method on a child instance (tracing, fault injection)."""
        connectors = self.children.connectors
        self._lookups = [c.get_num_new_matched_tokens for c in connectors]
        self.allocs = [c.update_state_after_alloc for c in connectors]
        self._new_request = [c.on_new_request for c in connectors]
        self._finishers: list[Finisher] = [c.request_finished for c in connectors]
        self._finishers_all_groups: list[Finisher] = [
            c.request_finished_all_groups
            if supports_hma(c)  # type: ignore[attr-defined]
            else self._one_group(c)
            for c in connectors
        ]

    def _one_group(self, child: KVConnectorBase_V1) -> Finisher:
        def finish(request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
            if len(block_ids) != 1:
                raise ValueError(
                    f"kvcompose[{self.name}]: {type(child).__name__} does not "
                    f"support HMA but the request has {len(block_ids)} KV groups"
                )
            return child.request_finished(request, block_ids[0])

        return finish

    # ------------------------------------------------------------ introspection
    def live(self) -> dict[str, Any]:
        tables: dict[str, Any] = {}
        if len(self.ledger):
            tables["ledger"] = self.ledger.snapshot()
        if self._partial_tails:
            tables["partial_tails"] = {k: sorted(v) for k, v in self._partial_tails.items()}
        if len(self.finishes):
            tables["after_finish"] = self.finishes.snapshot()
        return tables

    def ownership(self) -> dict[str, dict[str, object]]:
        table = self.ledger.snapshot(self.children.names)
        for record in table.values():
            owner = record["owner"]
            record["owner"] = None if owner is None else self.children.names[owner]  # type: ignore[index]
        return table

    # --------------------------------------------------------- lookup and alloc
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        record = self.ledger.get(req_id)
        if record is None:
            timed_out, excluded = False, frozenset()
        else:
            timed_out = (
                record.state is LoadState.PENDING
                and record.pending_since is not None
                and time.monotonic() - record.pending_since >= self._lookup_timeout_s
            )
            excluded = record.excluded
        if self._stitching:
            return stitch.lookup(self, request, num_computed_tokens, record, timed_out, excluded)
        candidates = self._fixed_candidates or self.policy.candidates(request)
        longest = self._longest
        # what each child answered, kept only for the debug decision record
        trace: list[str] | None = [] if self.debug else None
        best: tuple[int, int, bool] | None = None  # (child, tokens, async)
        pending = False
        timeouts: list[int] = []
        disabled = self.guard.disabled
        for child in candidates.children:
            if child in disabled:
                continue
            if child in excluded:
                if trace is not None:
                    trace.append(f"{self.children.names[child]}=excluded(failed)")
                continue
            try:
                result = self._lookups[child](request, num_computed_tokens)
            except Exception as exc:
                self.guard.child_error(child, "get_num_new_matched_tokens", exc)
                result = (0, False)
            if (
                type(result) is tuple
                and len(result) == 2
                and type(result[0]) is int
                and (result[0] > 0 or not result[1])
            ):
                tokens, is_async = result  # well formed: the common case, checked inline
            else:
                tokens, is_async = self.guard.normalise_lookup(child, result)
            if trace is not None:
                mark = "a" if is_async and tokens else ""
                trace.append(f"{self.children.names[child]}={tokens}{mark}")
            if tokens is None:
                if timed_out:
                    timeouts.append(child)
                    continue
                pending = True
                if longest:
                    continue
                break
            if tokens > 0 and (best is None or (longest and tokens > best[1])):
                best = (child, tokens, is_async)
                if self._stop_at_hit:
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
            logger.debug(
                "kvcompose[%s] %s: asked [%s] → owner %s, %d tokens%s, by %s",
                self.name,
                req_id,
                ", ".join(trace),
                "none" if owner is None else self.children.names[owner],
                tokens,
                " async" if is_async else "",
                reason,
            )
        return tokens, is_async

    def ask(self, child: int, request: Request, at: int) -> tuple[int | None, bool]:
        """One child's lookup at ``at``, through the guard (a raise is a miss)."""
        try:
            result = self._lookups[child](request, at)
        except Exception as exc:
            self.guard.child_error(child, "get_num_new_matched_tokens", exc)
            return 0, False
        if (
            type(result) is tuple
            and len(result) == 2
            and type(result[0]) is int
            and (result[0] > 0 or not result[1])
        ):
            return result
        return self.guard.normalise_lookup(child, result)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        record = self.ledger.allocated(req_id, num_external_tokens)
        if record is not None and record.segments:
            stitch.allocated(self, record, request, blocks, num_external_tokens)
            return
        owner = record.owner if record is not None else None
        for i, alloc in enumerate(self.allocs):
            n = num_external_tokens if i == owner else 0
            try:
                alloc(request, blocks, n)
            except Exception as exc:
                if n > 0:
                    raise  # the scheduler already counts these tokens: a load must happen
                self.guard.child_error(i, "update_state_after_alloc", exc)
        if num_external_tokens > 0 and record is not None and owner is not None:
            record.load_blocks = self._load_blocks(blocks, record.local_tokens, num_external_tokens)
            if record.state is LoadState.LOADING:
                self._step_loads[req_id] = owner
            elif record.state is LoadState.LOADED:
                self._step_sync_loads[req_id] = (owner, record.load_blocks)

    def _load_blocks(self, blocks: KVCacheBlocks, local_tokens: int, n: int) -> tuple[int, ...]:
        """The block ids a load of ``n`` tokens after ``local_tokens`` writes (group 0)."""
        block_size = self.block_size
        first = local_tokens // block_size
        last = -(-(local_tokens + n) // block_size)
        return tuple(blocks.get_block_ids()[0][first:last])

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        record = self.ledger.get(request.request_id)
        default = self.base_hit_sources(request, num_external_tokens)
        if record is not None and record.segments:
            return stitch.hit_sources(self, record, request) or default
        owner = None if record is None else record.owner
        if owner is None:
            return default
        return self.children.call(
            owner, "get_external_cache_hit_sources", default, request, num_external_tokens
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        record = self.ledger.get(request.request_id)
        if record is not None and record.segments:
            return stitch.group_ids(self, record, request)
        owner = None if record is None else record.owner
        if owner is None:
            return self._base_group_ids(request)
        return self.children.connectors[owner].get_loaded_kv_cache_group_ids(request)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CompositeMetadata:
        self.debug = logger.isEnabledFor(logging.DEBUG)
        children = tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
        metadata = CompositeMetadata(
            children,
            self._step_loads,
            self._step_sync_loads,
            self._step_sends,
            self.step_stitches,
            self.step_sync_segments,
            self._block_level_failures,
        )
        self._step_loads, self._step_sync_loads, self._step_sends = {}, {}, {}
        self.step_stitches, self.step_sync_segments = {}, {}
        return metadata

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the step's output as if it were the only connector
        (``kvcompose.composite.output_routing``)."""
        self._outputs.route(connector_output)

    # ------------------------------------------------------------------ finishing
    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        args = (request, block_ids, partial_tail_offloads)
        call = self.children.call
        accepted = {
            i
            for i in range(len(self.children.connectors))
            if call(i, "register_finished_partial_tail", False, *args)
        }
        if accepted:
            self._partial_tails[request.request_id] = accepted
        return bool(accepted)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finish(request, block_ids, self._finishers)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finish(request, block_ids, self._finishers_all_groups)

    def _finish(
        self, request: Request, block_ids: Any, finishers: list[Finisher]
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
        # aborted while loading: the loaders' receive still comes (one, for a stitch)
        loaders = None
        if record is not None and record.state is LoadState.LOADING:
            loaders = record.receivers()
        if first_error is not None:
            if loaders is not None:
                self.finishes.finished(req_id, loaders, ())
            raise first_error
        if delaying:
            senders = self._step_sends[req_id] = tuple(sorted(delaying))
            self.finishes.finished(req_id, loaders, senders)
            return True, merged
        if loaders is not None:
            self.finishes.finished(req_id, loaders, ())
        return False, merged

    def _merge_params(
        self,
        merged: dict[str, Any] | None,
        params: dict[str, Any],
        producer: dict[str, int],
        child: int,
        req_id: str,
    ) -> dict[str, Any]:
        merged = {} if merged is None else merged
        for key, value in params.items():
            if key in producer and merged[key] != value:
                other = self.children.names[producer[key]]
                self.guard.violation(
                    child,
                    "params_clash",
                    f"kv_transfer_params key {key!r} for {req_id} also set "
                    f"by {other!r}; keeping {other!r}'s value",
                )
                continue
            producer.setdefault(key, child)
            merged.setdefault(key, value)
        return merged

    # ------------------------------------------------------ the other members
    def on_new_request(self, request: Request) -> None:
        for i, new_request in enumerate(self._new_request):
            try:
                new_request(request)
            except Exception as exc:
                self.guard.child_error(i, "on_new_request", exc)
