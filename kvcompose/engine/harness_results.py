"""What ``SchedulerHarness`` reports: finished requests, one step's result, a stuck run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import KVConnectorOutput


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
