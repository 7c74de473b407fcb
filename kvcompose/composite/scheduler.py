"""The scheduler half of a composite node: who loads each request, and when it is done.

It holds the node's one lookup rule (``kvcompose.composite.lookup.Lookup``, with ``fastest``'s
costs), the load ledger and the finish records (``kvcompose.composite.ledger``), and what one
step hands to the worker half: the async loads given out (owner per request), the sync loads
(owner and blocks), and the requests whose free waits for children's sends
(``CompositeMetadata``). What each child is shown of a step's output is
``kvcompose.composite.output_routing``'s job; a stitched load's allocation, rounds and
recovery are ``kvcompose.composite.stitch.StitchPlanner``'s.

On a model with several KV cache groups vLLM takes load failures by request only
(``Scheduler._handle_invalid_blocks`` raises on invalid block ids; ``failed_recving`` exists
for async loads alone), so the node parks its sync loads: it tells vLLM they are async, and
the request waits one step while its children load (``Ledger.park``). A sync load of a child
that cannot be parked is not taken.

vLLM's scheduler calls ``get_num_new_matched_tokens`` for every waiting request every step,
and ``update_state_after_alloc`` / ``request_finished`` once or twice per request: those paths
call the children through bound methods cached by ``refresh_child_methods`` and check the
common well-formed answers inline (the lookup's in ``Lookup.answer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, supports_hma

from kvcompose import tree as nodes
from kvcompose.composite.children import Children
from kvcompose.composite.finishes import Finishes
from kvcompose.composite.forwarding import SchedulerForwarding
from kvcompose.composite.ledger import Ledger, LedgerError, LoadState
from kvcompose.composite.lookup import Lookup
from kvcompose.composite.metadata import ComposedWorkerMeta, CompositeMetadata
from kvcompose.composite.output_routing import OutputRouter
from kvcompose.composite.params_merge import merge_params
from kvcompose.composite.policies.factory import build_policy
from kvcompose.composite.stats import NodeCounters
from kvcompose.composite.stitch import StitchPlanner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvcompose")

Finisher = Callable[["Request", Any], tuple[bool, dict[str, Any] | None]]

#: Load states in which vLLM holds a request parked: a receive is still to come.
_IN_FLIGHT = frozenset({LoadState.LOADING, LoadState.RECOVERING})


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
        self.block_size = vllm_config.cache_config.block_size
        self.base_hit_sources = base_hit_sources
        self._base_group_ids = base_group_ids
        connectors = children.connectors
        self.divergent_hits = bool(connectors) and all(
            c.supports_divergent_local_hybrid_hits for c in connectors
        )
        self.ledger = Ledger(
            nested=frozenset(
                i
                for i, c in enumerate(connectors)
                if isinstance(getattr(c, "ledger", None), Ledger)
            )
        )
        self._ledger_ids = self.ledger.ids
        policy = build_policy(
            tree,
            self.block_size,
            self.ledger,
            counters,
            ask_every_child=ask_every_child,
            vllm_config=vllm_config,
        )
        self.costs = policy.costs  # (``fastest``'s cost model; None for other policies)
        self.lookup = Lookup(name, tree, children, counters, self.ledger, self.block_size, policy)
        self.stitches = StitchPlanner(
            self.lookup, base_hit_sources, block_level_failures=num_kv_groups <= 1
        )
        self.finishes = Finishes()
        self._outputs = OutputRouter(self.ledger, self.finishes, children)
        # several KV cache groups: vLLM takes no invalid block ids, so every failure goes up by
        # request, and sync loads are parked (``Ledger.park``) so that theirs can
        self.by_request = num_kv_groups > 1
        if self.by_request:
            self.lookup.park_only()  # a sync hit that cannot be parked is not planned
            self.get_num_new_matched_tokens = self._answer_parked  # type: ignore[method-assign]
        self._partial_tails: dict[str, set[int]] = {}  # accepted tails, until the finish
        self._step_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._step_sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._step_sends: dict[str, tuple[int, ...]] = {}
        self.refresh_child_methods()

    def refresh_child_methods(self) -> None:
        """Cache the children's bound methods used on the per-request hot paths. Call again
        after replacing a method on a child instance (tracing, fault injection).

        ``on_new_request`` and ``request_finished`` are called only on the children that
        implement them (``Children.implementing``): vLLM's base class's own do nothing and
        return ``None`` and ``(False, None)``, which the node's answers ignore."""
        children = self.children
        children.refresh()
        connectors = children.connectors
        self.lookup.refresh(
            self.guard.watch_lookups([c.get_num_new_matched_tokens for c in connectors])
        )
        self.allocs = [c.update_state_after_alloc for c in connectors]
        self.stitches.allocs = self.allocs
        self._every_alloc = tuple(enumerate(self.allocs))
        self._new_request = tuple(
            (i, connectors[i].on_new_request) for i in children.implementing("on_new_request")
        )
        self._finishers: tuple[tuple[int, Finisher], ...] = tuple(
            (i, connectors[i].request_finished) for i in children.implementing("request_finished")
        )
        # every child: the one-group wrapper refuses several KV groups, whatever the child
        self._finishers_all_groups: tuple[tuple[int, Finisher], ...] = tuple(
            (i, c.request_finished_all_groups if supports_hma(c) else self._one_group(c))  # type: ignore[attr-defined]
            for i, c in enumerate(connectors)
        )
        self._outputs.refresh()

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
        """Every policy's answer comes from the one rule (``kvcompose.composite.lookup``)."""
        return self.lookup.answer(request, num_computed_tokens)

    def _answer_parked(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` on several KV cache groups: the one rule's answer,
        a sync load parked (told to vLLM as async: its failure can then be reported by
        request, ``Ledger.park``). The lookup plans under ``park_only``: a sync hit of a child
        that cannot be parked is not taken (its failure could not be reported at all: vLLM
        would use or keep garbage, or die), so every sync plan it answers parks."""
        tokens, is_async = self.lookup.answer(request, num_computed_tokens)
        if is_async or not tokens:
            return tokens, is_async
        record = self.ledger.get(request.request_id)
        if record is None or not self.ledger.park(record, self.lookup.range_supports):
            raise LedgerError(
                f"kvcompose[{self.name}]: request {request.request_id}: a sync plan under "
                "park_only that cannot be parked"
            )
        return tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if num_external_tokens == 0 and self.ledger.get(req_id) is None:
            # a request the node holds nothing for: every child hears 0 (the common case)
            for i, alloc in self._every_alloc:
                try:
                    alloc(request, blocks, 0)
                except Exception as exc:
                    self.guard.child_error(i, "update_state_after_alloc", exc)
            return
        record = self.ledger.allocated(req_id, num_external_tokens)
        if self.costs is not None and record is not None and record.state is LoadState.NO_LOAD:
            self.costs.forget(req_id)  # granted nothing: no load to time
        if record is not None and record.segments:
            self.stitches.allocated(record, request, blocks, num_external_tokens)
            return
        owner = record.owner if record is not None else None
        for i, alloc in self._every_alloc:
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
                self._step_loads[req_id] = (owner, record.load_blocks)
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
            return self.stitches.hit_sources(record, request) or default
        owner = None if record is None else record.owner
        if owner is None:
            return default
        return self.children.call(
            owner, "get_external_cache_hit_sources", default, request, num_external_tokens
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        record = self.ledger.get(request.request_id)
        if record is not None and record.segments:
            return self.stitches.group_ids(record, request)
        owner = None if record is None else record.owner
        if owner is None:
            return self._base_group_ids(request)
        return self.children.connectors[owner].get_loaded_kv_cache_group_ids(request)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CompositeMetadata:
        self.lookup.set_debug(logger.isEnabledFor(logging.DEBUG))
        if self.costs is not None:  # the previous step's time measures prefill
            self.costs.step(scheduler_output.total_num_scheduled_tokens)
        if self._outputs.recovering:  # receives held back for a recovery round
            self._recovery_round()
        children = tuple([c.build_connector_meta(scheduler_output) for c in self._connectors])
        stitches, sync_segments, invalid_blocks = self.stitches.take_step()
        metadata = CompositeMetadata(
            children,
            self._step_loads,
            self._step_sync_loads,
            self._step_sends,
            stitches,
            sync_segments,
        )
        self._step_loads, self._step_sync_loads, self._step_sends = {}, {}, {}
        if invalid_blocks:  # a stitch's sync range no segment loads
            metadata.invalid_blocks = invalid_blocks
        metadata.by_request = self.by_request
        return metadata

    def _recovery_round(self) -> None:
        """Plan the next round of this node's recovering stitched loads (before the children
        build: the reloads go out in this step), and expect again the receive of a nested
        node that holds one back."""
        held, self._outputs.recovering = self._outputs.recovering, []
        own = [req_id for req_id, child in held if child is None]
        if own:
            self.stitches.recover(own)
        for req_id, child in held:
            if child is not None:
                record = self.ledger.get(req_id)
                blocks = record.load_blocks if record is not None else ()
                self._step_loads[req_id] = (child, blocks)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the step's output as if it were the only connector
        (``kvcompose.composite.output_routing``); ``fastest`` takes its loads' times."""
        if self.costs is not None:
            meta = connector_output.kv_connector_worker_meta
            if isinstance(meta, ComposedWorkerMeta) and meta.load_seconds:
                self._timed(meta.load_seconds)
        self._outputs.route(connector_output)
        if self.costs is not None and connector_output.finished_recving:
            # A receive vLLM sees (``route`` took out those held for a recovery round) ends
            # the request's async loads: their times came with it or before (the worker
            # ships a time in the step of its receive), so one not timed by now failed and
            # never will be. Awaiting it would keep a cold child from every other request
            # until this one finishes (``Costs.usable``).
            for req_id in connector_output.finished_recving:
                self.costs.forget(req_id, in_flight_only=True)

    def _timed(self, load_seconds: dict[tuple[str, int], float]) -> None:
        """Loads the worker half timed: fitted into their children's estimates, counted as
        predicted and actual seconds, and logged with the decision at debug level."""
        names = self.children.names
        for expected, seconds in self.costs.timed(load_seconds):  # type: ignore[union-attr]
            name = names[expected.child]
            self.counters.inc(f"load_seconds_predicted.{name}", expected.predicted_s)
            self.counters.inc(f"load_seconds_actual.{name}", seconds)
            if self.lookup.debug:
                logger.debug(
                    "kvcompose[%s] %s: %s loaded %d tokens in %.1f ms (predicted %.1f ms)",
                    self.name,
                    expected.req_id,
                    name,
                    expected.tokens,
                    seconds * 1000,
                    expected.predicted_s * 1000,
                )

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
        self, request: Request, block_ids: Any, finishers: tuple[tuple[int, Finisher], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        delaying = self._partial_tails.pop(req_id, None) if self._partial_tails else None
        merged: dict[str, Any] | None = None
        producer: dict[str, int] | None = None  # who set each key, once params come
        first_error: BaseException | None = None
        for i, finish in finishers:
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
                if producer is None:
                    producer = {}
                merged = merge_params(merged, params, producer, i, req_id, self.guard)
        # aborted while loading: the loaders' receive still comes (one, for a stitch; a
        # stitch recovering from a failed segment gets it in its next round)
        loaders = None
        if self.costs is not None:  # (``forget`` returns at once while none is in flight)
            self.costs.forget(req_id, in_flight_only=True)
        if req_id in self._ledger_ids:
            record = self.ledger.finished(req_id)
            if record is not None and record.state in _IN_FLIGHT:
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

    # ------------------------------------------------------ the other members
    def on_new_request(self, request: Request) -> None:
        for i, new_request in self._new_request:
            try:
                new_request(request)
            except Exception as exc:
                self.guard.child_error(i, "on_new_request", exc)
