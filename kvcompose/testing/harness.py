"""vLLM's real scheduler driven without a model: ``kvcompose.engine.harness``, under the name
the tests import."""

from kvcompose.engine.harness import FinishedRequest, HarnessStuck, SchedulerHarness, StepResult

__all__ = ["FinishedRequest", "HarnessStuck", "SchedulerHarness", "StepResult"]
