"""Engine-side functions for the LMCache tests (run inside an engine process through
``EngineProcess.call``; their first argument is that process's ``vllm.LLM``).

``corrupt_after_next_load`` is the negative control of an asynchronous load: the KV an engine
loaded is overwritten with noise right after the load finished and before the request's next
forward reads it, so an engine that really uses the loaded KV then decodes something else.
"""

from __future__ import annotations

from typing import Any

from kvcompose.engine import probe
from kvcompose.testing.pd import corrupt_request_blocks

#: What ``corrupt_after_next_load`` did (engine process only).
CORRUPTED: dict[str, int] = {}


def corrupt_after_next_load(llm: Any, seed: int = 0) -> None:
    """Arm a one-shot fault: the next time the worker-side connector reports a finished
    receive (``get_transfer_results``, which vLLM's model runner calls after each forward;
    the scheduler then schedules the request's remaining tokens in the next step), the
    request's KV blocks are overwritten with finite noise. ``corruption_report`` tells which
    request and how many blocks."""
    conn = probe.worker_connector()
    if conn is None:
        raise RuntimeError("the engine has no KV connector")
    original = conn.get_transfer_results
    CORRUPTED.clear()

    def results_then_corrupt(finished_req_ids: set[str]) -> Any:
        results = original(finished_req_ids)
        for req_id in sorted(results.finished_recving or ()):
            if not CORRUPTED:  # once
                CORRUPTED[req_id] = corrupt_request_blocks(llm, req_id, seed)
                conn.get_transfer_results = original  # disarmed
        return results

    conn.get_transfer_results = results_then_corrupt


def corruption_report(llm: Any) -> dict[str, int]:
    """``{request id: blocks overwritten}`` of the last ``corrupt_after_next_load``."""
    return dict(CORRUPTED)


def external_hit_tokens(llm: Any) -> float:
    """Prompt tokens this engine took from its connector so far (vLLM's
    ``external_prefix_cache_hits`` counter)."""
    from vllm.v1.metrics.reader import Counter

    return sum(
        m.value
        for m in llm.get_metrics()
        if isinstance(m, Counter) and m.name == "vllm:external_prefix_cache_hits"
    )
