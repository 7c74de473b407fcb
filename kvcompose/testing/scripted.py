"""Scripted child connectors: test doubles for *children* (never for vLLM).

A ``ScriptedConnector`` is a real ``KVConnectorBase_V1`` whose behaviour per request comes from
a ``Script``: how many tokens it holds, sync or async, how long it keeps answering ``None``,
whether its load succeeds, fails or corrupts blocks, whether it delays the free, which
``kv_transfer_params`` it returns, where it raises. Unless a behaviour says otherwise it obeys
vLLM's contract like a real connector; the ``break_*`` flags break it on purpose.

The scheduler and worker instances of one child find their shared ``Script`` by name
(``kv_connector_extra_config: {"script": NAME}``) in the process-wide ``SCRIPTS`` registry,
so the pair works wherever both run in one process (the scheduler harness, a single-process
engine). Every call is recorded in ``Script.calls`` for assertions, and so is what the child
reports (``("delay", req)`` when ``request_finished`` delays the free; on the worker side
``("sync_load", req, failed)`` when it binds a sync load (the step runs it),
``("recv_report", req, failed)``, ``("send_report", req)``, ``("invalid_report", block ids,
(req,))`` per request with bad blocks, and ``("invalid_lost", block ids, (req,))`` when it
raised while reporting them), plus
``("hit", req, n)`` for each numeric lookup answer and ``("stored", req, n, prompt
tokens)`` when a ``stores`` behaviour stored ``n`` tokens of a prompt.

**Raising.** ``raise_in`` names the methods that raise ``RuntimeError("scripted failure in
METHOD for REQ")`` for a request; each raise is recorded first as ``("raise", METHOD, req)``.
Scheduler-side methods raise on every call for the request. Worker-side methods raise once per
request and method, where the request is at work in that method, and before the child touches
any state (a transient error: its transfers go on, so what it would have reported comes in a
later step), except ``get_block_ids_with_load_errors``, whose pending bad blocks are consumed
by the failed call (lost with the exception, as a connector that pops its error set first):

- ``start_load_kv`` / ``wait_for_layer_load``: a load of the request is in this step's metadata
  (vLLM's model runner calls them around the forward, in
  ``KVConnectorModelRunnerMixin._get_kv_connector_output``, and per attention layer);
- ``save_kv_layer`` / ``wait_for_save``: the request is in this step's metadata (a load, an
  allocation or a send);
- ``get_transfer_results``: a receive or send of the request would be reported this step;
- ``get_block_ids_with_load_errors``: bad blocks of the request's load are pending.

A load covers the blocks after the local hit the lookup was shown (its ``num_computed_tokens``);
``invalid`` (and a sync ``fail``) reports the load's block number ``invalid_block`` (clamped)
as bad, so block 0 of a load with no local hit is a total failure, anything else partial.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcompose.engine.harness_worker import WORKER_RANK

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

LoadOutcome = Literal["ok", "fail", "invalid"]


@dataclass
class Behaviour:
    tokens: int = 0  # prompt tokens this child holds (its hit is this minus the local hit)
    is_async: bool = False
    pending_lookups: int = 0  # answer None this many times first
    load: LoadOutcome = "ok"  # fail: request-level failed_recving; invalid: bad block ids
    load_steps: int = 1  # async: worker steps until the load is reported
    delay_free: bool = False  # request_finished returns True
    send_steps: int = 1  # worker steps after the finish until finished_sending
    params: dict[str, Any] | None = None  # kv_transfer_params from request_finished
    raise_in: frozenset[str] = frozenset()  # method names that raise RuntimeError (see above)
    break_zero_async: bool = False  # lookup returns (0, True)
    # answer every prompt token it holds, the last one too: vLLM's scheduler needs one token
    # to compute after a sync load (its own connectors hold back the last one)
    break_whole_prompt: bool = False
    # a raise in get_transfer_results loses the receives due then: the child never reports
    # them (a connector whose transfer state went down with the exception)
    raise_loses_reports: bool = False
    break_rogue_recv: bool = False  # reports finished_recving for every allocation it sees
    break_duplicate_recv: bool = False  # reports its receive twice
    break_rogue_send: bool = False  # reports finished_sending without delaying
    invalid_block: int = 0  # invalid: which of the load's blocks is bad (0: the first)
    # False: as a correct connector, never delay the free while this child's own async load
    # for the request is in flight (it must report finished_recving then: one terminal
    # signal per request). True (the default) delays regardless, which breaks that rule
    # when the request is aborted while it loads.
    delay_free_if_loading: bool = True
    # How many of this child's loads for the request go as ``load`` says; later ones are
    # "ok" (a transient failure). None: every load.
    failed_loads: int | None = None
    # Load every unhashed block it is handed, whatever the count and its lookup argument,
    # as vLLM's NixlConnector does on a decode worker (``NixlPullConnectorScheduler.
    # update_state_after_alloc``: ``blocks.get_unhashed_block_ids_all_groups()``; the worker
    # keeps the last ``len(local)`` remote blocks, ``NixlBaseConnectorWorker.
    # _apply_prefix_caching``).
    loads_unhashed: bool = False
    # Hold what earlier requests stored instead of ``tokens``: when a request finishes, the
    # child stores the whole blocks of its prompt that vLLM had computed (an abort or a
    # failure mid-prefill stores part of the prompt, a prompt's last partial block is never
    # stored), and a lookup hits the longest stored prefix of the prompt. As vLLM's
    # OffloadingConnector: it stores whole chunks only (``RequestOffloadState.
    # storable_chunks``), up to ``num_computed_tokens`` for an aborted request and the prompt
    # otherwise (``OffloadingConnectorScheduler._build_store_jobs`` and
    # ``_calc_num_offloadable_tokens`` with ``offload_prompt_only``).
    stores: bool = False
    # Tensor parallelism (``SchedulerHarness(num_workers=N)``): the load's failure (``fail``,
    # ``invalid``) happens on these worker ranks only, the others load fine. None: every rank.
    fails_on_ranks: frozenset[int] | None = None


@dataclass
class Script:
    default: Behaviour = field(default_factory=Behaviour)
    per_request: dict[str, Behaviour] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    finished: Counter[str] = field(default_factory=Counter)
    #: Prompt prefixes (whole blocks) stored by ``stores`` behaviours, shared by all requests.
    stored: set[tuple[int, ...]] = field(default_factory=set)

    def stored_prefix(self, prompt: list[int], block_size: int) -> int:
        """How many leading tokens of ``prompt`` are stored (whole blocks)."""
        n = 0
        while (n + block_size <= len(prompt)) and tuple(prompt[: n + block_size]) in self.stored:
            n += block_size
        return n

    def behaviour(self, req_id: str) -> Behaviour:
        return self.per_request.get(req_id, self.default)

    def allocations(self, req_id: str) -> list[tuple[int, tuple[int, ...]]]:
        """``(num_external_tokens, block ids)`` of every update_state_after_alloc call."""
        return [(c[2], c[3]) for c in self.calls if c[0] == "alloc" and c[1] == req_id]

    def lookups(self, req_id: str) -> int:
        return sum(1 for c in self.calls if c[0] == "lookup" and c[1] == req_id)

    def delayed(self, req_id: str) -> bool:
        """Whether ``request_finished`` for the request returned True."""
        return any(c[0] == "delay" and c[1] == req_id for c in self.calls)

    def recv_reports(self, req_id: str) -> list[bool]:
        """The worker's ``finished_recving`` reports for the request (True: also failed)."""
        return [c[2] for c in self.calls if c[0] == "recv_report" and c[1] == req_id]

    def send_reports(self, req_id: str) -> int:
        return sum(1 for c in self.calls if c[0] == "send_report" and c[1] == req_id)


SCRIPTS: dict[str, Script] = {}


def script(name: str, default: Behaviour | None = None, **per_request: Behaviour) -> Script:
    """Create (or replace) the script named ``name``."""
    SCRIPTS[name] = Script(default=default or Behaviour(), per_request=dict(per_request))
    return SCRIPTS[name]


def direct(script_name: str) -> dict[str, Any]:
    """The ``kv_transfer_config`` of a scripted connector that vLLM loads itself, with no
    kvcompose node (what a test compares kvcompose against, or vLLM alone)."""
    return {
        "kv_connector": "ScriptedConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvcompose.testing.scripted",
        "kv_connector_extra_config": {"script": script_name},
    }


def leaf(name: str, script_name: str | None = None, **fields: Any) -> dict[str, Any]:
    """The canonical dict of a leaf node running the script ``script_name`` (default: name)."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "ScriptedConnector",
        "module_path": "kvcompose.testing.scripted",
        "extra_config": {"script": script_name or name},
        **fields,
    }


@dataclass
class _Load:
    tokens: int
    is_async: bool
    outcome: LoadOutcome
    steps: int
    block_ids: tuple[int, ...]
    duplicate: bool
    invalid_block: int = 0

    def bad_blocks(self) -> list[int]:
        # Never vLLM's null block (id 0, ``BlockPool.null_block``): it holds no KV (a sliding
        # window's blocks behind the window), so no connector loads into it or names it.
        real = [b for b in self.block_ids if b != 0]
        if not real:
            return []
        i = min(self.invalid_block, len(real) - 1)
        return [real[i]]


@dataclass
class ScriptedMetadata(KVConnectorMetadata):
    loads: dict[str, _Load] = field(default_factory=dict)
    sends: dict[str, int] = field(default_factory=dict)
    allocated: tuple[str, ...] = ()


class ScriptedConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        name = self._kv_transfer_config.get_from_extra_config("script", None)
        self.script = SCRIPTS[name]
        self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._pending_seen: Counter[str] = Counter()
        self._lookup_at: dict[str, int] = {}  # the local hit the last lookup was shown
        self._loading: set[str] = set()  # own async loads not yet reported finished
        self._loads_made: Counter[str] = Counter()
        self._step = ScriptedMetadata()
        # worker side
        self._recv_timers: dict[str, tuple[int, _Load]] = {}
        self._send_timers: dict[str, int] = {}
        self._invalid: dict[str, set[int]] = {}  # request -> its bad blocks, pending
        self._rogue: set[str] = set()
        self._worker_raised: set[tuple[str, str]] = set()
        self._rank = WORKER_RANK.get() if role == KVConnectorRole.WORKER else 0

    def _maybe_raise(self, method: str, req_id: str) -> None:
        if method in self.script.behaviour(req_id).raise_in:
            self.script.calls.append(("raise", method, req_id))
            raise RuntimeError(f"scripted failure in {method} for {req_id}")

    def _maybe_raise_once(self, method: str, req_ids: Any) -> None:
        """Worker side: raise for the first request of ``req_ids`` scripted to raise in
        ``method`` and not raised for there yet."""
        for req_id in sorted(req_ids):
            if (method, req_id) in self._worker_raised:
                continue
            if method in self.script.behaviour(req_id).raise_in:
                self._worker_raised.add((method, req_id))
                self._maybe_raise(method, req_id)

    # ---------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self.script.calls.append(("lookup", req_id, num_computed_tokens))
        self._lookup_at[req_id] = num_computed_tokens
        self._maybe_raise("get_num_new_matched_tokens", req_id)
        b = self.script.behaviour(req_id)
        if self._pending_seen[req_id] < b.pending_lookups:
            self._pending_seen[req_id] += 1
            return None, False
        if b.break_zero_async:
            return 0, True
        tokens = b.tokens
        if b.stores:
            tokens = self.script.stored_prefix(request.prompt_token_ids or [], self._block_size)
        held = min(tokens, request.num_prompt_tokens - (0 if b.break_whole_prompt else 1))
        hit = held - num_computed_tokens
        self.script.calls.append(("hit", req_id, max(hit, 0)))
        return (hit, b.is_async) if hit > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        block_ids = tuple(blocks.get_block_ids()[0]) if blocks is not None else ()
        self.script.calls.append(("alloc", req_id, num_external_tokens, block_ids))
        self._maybe_raise("update_state_after_alloc", req_id)
        self._step.allocated += (req_id,)
        if num_external_tokens > 0:
            b = self.script.behaviour(req_id)
            # The load starts after the local hit the lookup was shown (the scheduler has not
            # advanced request.num_computed_tokens yet when it calls this).
            start = self._lookup_at.get(req_id, request.num_computed_tokens)
            first = start // self._block_size
            last = -(-(start + num_external_tokens) // self._block_size)
            if b.loads_unhashed:
                block_ids = tuple(blocks.get_unhashed_block_ids_all_groups()[0])
                first, last = 0, len(block_ids)
                self.script.calls.append(("loaded_blocks", req_id, block_ids))
            self._loads_made[req_id] += 1
            outcome = b.load
            if b.failed_loads is not None and self._loads_made[req_id] > b.failed_loads:
                outcome = "ok"
            self._step.loads[req_id] = _Load(
                num_external_tokens,
                b.is_async,
                outcome,
                b.load_steps,
                block_ids[first:last],
                b.break_duplicate_recv,
                b.invalid_block,
            )
            if b.is_async:
                self._loading.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._step = self._step, ScriptedMetadata()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self.script.calls.append(("finished", req_id, tuple(block_ids)))
        self.script.finished[req_id] += 1
        self._pending_seen.pop(req_id, None)
        self._lookup_at.pop(req_id, None)
        self._loads_made.pop(req_id, None)
        loading = req_id in self._loading
        self._loading.discard(req_id)
        self._maybe_raise("request_finished", req_id)
        b = self.script.behaviour(req_id)
        if b.stores:
            computed = min(request.num_computed_tokens, request.num_prompt_tokens)
            prompt = request.prompt_token_ids or []
            whole = computed // self._block_size * self._block_size
            for end in range(self._block_size, whole + 1, self._block_size):
                self.script.stored.add(tuple(prompt[:end]))
            self.script.calls.append(("stored", req_id, whole, request.num_prompt_tokens))
        delay = b.delay_free and (b.delay_free_if_loading or not loading)
        if delay or b.break_rogue_send:
            self._step.sends[req_id] = b.send_steps
        if delay:
            self.script.calls.append(("delay", req_id))
        return delay, (dict(b.params) if b.params else None)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def live_requests(self) -> dict[str, Any]:
        live: dict[str, Any] = {}
        for key, table in (
            ("pending", self._pending_seen),
            ("lookup_at", self._lookup_at),
            ("loading", self._loading),
            ("loads_made", self._loads_made),
        ):
            if table:
                live[key] = sorted(table)
        if self._recv_timers:
            live["recv"] = sorted(self._recv_timers)
        if self._send_timers:
            live["send"] = sorted(self._send_timers)
        return live

    # ------------------------------------------------------------------- worker
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, ScriptedMetadata)
        for req_id, load in connector_metadata.loads.items():
            if load.is_async:
                self._recv_timers[req_id] = (load.steps, load)
                continue
            failed = self._outcome(req_id, load) != "ok"
            self.script.calls.append(("sync_load", req_id, failed))
            if failed:
                self._invalid.setdefault(req_id, set()).update(load.bad_blocks())
        self._send_timers.update(connector_metadata.sends)
        if any(self.script.behaviour(r).break_rogue_recv for r in connector_metadata.allocated):
            self._rogue.update(connector_metadata.allocated)

    def _step_requests(self, *, loads_only: bool) -> set[str]:
        metadata = self._connector_metadata
        if not isinstance(metadata, ScriptedMetadata):
            return set()
        if loads_only:
            return set(metadata.loads)
        return set(metadata.loads) | set(metadata.allocated) | set(metadata.sends)

    def _outcome(self, req_id: str, load: _Load) -> LoadOutcome:
        """How the load goes on this worker's rank (``Behaviour.fails_on_ranks``)."""
        ranks = self.script.behaviour(req_id).fails_on_ranks
        return load.outcome if ranks is None or self._rank in ranks else "ok"

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._maybe_raise_once("start_load_kv", self._step_requests(loads_only=True))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._maybe_raise_once("wait_for_layer_load", self._step_requests(loads_only=True))

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._maybe_raise_once("save_kv_layer", self._step_requests(loads_only=False))

    def wait_for_save(self) -> None:
        self.script.calls.append(("wait_for_save",))
        self._maybe_raise_once("wait_for_save", self._step_requests(loads_only=False))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        due = [r for r, (steps, _) in self._recv_timers.items() if steps <= 1]
        due += [r for r, steps in self._send_timers.items() if steps <= 1]
        try:
            self._maybe_raise_once("get_transfer_results", due)
        except RuntimeError:
            for req_id in due:
                if self.script.behaviour(req_id).raise_loses_reports:
                    self._recv_timers.pop(req_id, None)
            raise
        out = KVConnectorTransferResults()
        if self._rogue:  # signals this child should not send
            out.finished_recving |= self._rogue
            self._rogue = set()
        for req_id, (steps, load) in list(self._recv_timers.items()):
            if steps > 1:
                self._recv_timers[req_id] = (steps - 1, load)
                continue
            del self._recv_timers[req_id]
            out.finished_recving.add(req_id)
            outcome = self._outcome(req_id, load)
            if outcome == "fail":
                out.failed_recving.add(req_id)
            elif outcome == "invalid":
                self._invalid.setdefault(req_id, set()).update(load.bad_blocks())
            if load.duplicate:
                self._rogue.add(req_id)
        for req_id, steps in list(self._send_timers.items()):
            if steps > 1:
                self._send_timers[req_id] = steps - 1
                continue
            del self._send_timers[req_id]
            out.finished_sending.add(req_id)
        for req_id in sorted(out.finished_recving):
            self.script.calls.append(("recv_report", req_id, req_id in out.failed_recving))
        for req_id in sorted(out.finished_sending):
            self.script.calls.append(("send_report", req_id))
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        pending, self._invalid = self._invalid, {}
        errors = set().union(*pending.values())
        try:
            self._maybe_raise_once("get_block_ids_with_load_errors", set(pending))
        except RuntimeError:
            for req_id, bad in sorted(pending.items()):
                self.script.calls.append(("invalid_lost", tuple(sorted(bad)), (req_id,)))
            raise
        for req_id, bad in sorted(pending.items()):
            self.script.calls.append(("invalid_report", tuple(sorted(bad)), (req_id,)))
        return errors


class ScriptedHMAConnector(ScriptedConnector, SupportsHMA):
    """A ``ScriptedConnector`` that supports vLLM's hybrid KV cache manager (``leaf(...,
    connector="ScriptedHMAConnector")``): for trees of ``KVComposeHMA`` on a model with
    several KV cache groups. It hears the finish with every group's blocks; what it loads and
    reports is its parent's (group 0's block ids, the first group vLLM lists)."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.script.calls.append(("finished_groups", request.request_id, len(block_ids)))
        return self.request_finished(request, block_ids[0])
