"""Read a running engine's kvcompose state from Python: per-node counters and the live
ownership table. Works for engines whose scheduler runs in this process (``vllm.LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); multi-process engines report through vLLM's stats
logging and Prometheus instead (see docs/observability.md)."""

from __future__ import annotations

from typing import Any


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process ``vllm.LLM`` (or ``LLMEngine``)."""
    from kvcompose.engine.probe import scheduler_connector as probe

    return probe(llm)


def worker_connector() -> Any:
    """The worker-side connector of this process (single-process engines)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def node_stats(llm: Any) -> dict[str, Any]:
    """Counters since start of every composite node, nested like the tree."""
    return scheduler_connector(llm).stats_totals()


def ownership(llm: Any) -> dict[str, dict[str, object]]:
    """The root node's live ownership table (request id → state, owner, tokens, reason)."""
    return scheduler_connector(llm).ownership()
