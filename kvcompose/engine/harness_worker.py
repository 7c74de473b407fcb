"""The worker half of ``SchedulerHarness``: the WORKER-role connector, made as EngineCore
makes it, and driven through one step the way vLLM's model runner drives it (no model, no KV
caches: for connectors whose worker half needs no tensors, such as the scripted doubles)."""

from __future__ import annotations

import contextvars
import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput


#: The tensor-parallel rank whose worker runs now (vLLM keeps it per worker process, in
#: ``vllm.distributed.parallel_state``; here all ranks share one process, so it is set around
#: each rank's construction and step). Test doubles read it to fail on one rank only.
WORKER_RANK: contextvars.ContextVar[int] = contextvars.ContextVar("worker_rank", default=0)


def make_worker_connectors(
    vllm_config: Any, kv_cache_config: Any, scheduler_connector: Any, num_workers: int = 1
) -> list[Any]:
    """The WORKER-role connectors of ``vllm_config``, one per tensor-parallel rank (each a
    separate instance, as each worker process builds its own), their handshake metadata
    handed to the scheduler side as EngineCore does at start-up."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    workers = []
    for rank in range(num_workers):
        token = WORKER_RANK.set(rank)
        try:
            workers.append(
                KVConnectorFactory.create_connector(
                    config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
                )
            )
        finally:
            WORKER_RANK.reset(token)
    # No KV caches are registered (there is no model), so connectors that need them cannot
    # run a worker here.
    # As EngineCore at start-up (``v1/engine/core.py``, after the output aggregator): the
    # workers' handshake metadata, keyed by (pp_rank, tp_rank), goes to the scheduler side;
    # when no worker has any the call still comes, with {}. (Without a worker there is
    # nothing to report, and EngineCore makes no call.)
    handshakes = {(0, rank): w.get_handshake_metadata() for rank, w in enumerate(workers)}
    scheduler_connector.set_xfer_handshake_metadata_pp_aware(
        {key: hs for key, hs in handshakes.items() if hs is not None}
    )
    return workers


def run_worker_step(
    wc: Any, so: SchedulerOutput, vllm_config: Any, layer_names: list[str]
) -> KVConnectorOutput:
    """One step of the worker half in the model runner's order, its output collected.
    ``layer_names``: the per-layer calls to make (no tensors: for scripted children only)."""
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.v1.outputs import KVConnectorOutput

    meta = so.kv_connector_metadata
    assert meta is not None, "the scheduler built no connector metadata"
    out = KVConnectorOutput()
    wc.handle_preemptions(meta)
    wc.bind_connector_metadata(meta)
    with set_forward_context(None, vllm_config):
        wc.start_load_kv(get_forward_context())
        if so.total_num_scheduled_tokens > 0:
            for layer in layer_names:
                wc.wait_for_layer_load(layer)
                wc.save_kv_layer(layer, None, None)
        wc.wait_for_save()
    results = wc.get_transfer_results(so.finished_req_ids)
    out.finished_sending = set(results.finished_sending or ())
    out.finished_recving = set(results.finished_recving or ())
    out.failed_recving = set(getattr(results, "failed_recving", None) or ())
    out.invalid_block_ids = set(wc.get_block_ids_with_load_errors() or ())
    out.kv_connector_stats = wc.get_kv_connector_stats()
    out.kv_cache_events = wc.get_kv_connector_kv_cache_events()
    out.kv_connector_worker_meta = wc.build_connector_worker_meta()
    wc.clear_connector_metadata()
    return out


def run_worker_steps(
    workers: list[Any], so: SchedulerOutput, vllm_config: Any, layer_names: list[str]
) -> list[KVConnectorOutput]:
    """Every rank's worker step, rank by rank; each rank binds its own copy of the metadata,
    as each worker process unpickles its own."""
    first = so.kv_connector_metadata
    metas = [first, *(copy.deepcopy(first) for _ in workers[1:])]
    outs = []
    try:
        for rank, (wc, meta) in enumerate(zip(workers, metas, strict=True)):
            so.kv_connector_metadata = meta
            token = WORKER_RANK.set(rank)
            try:
                outs.append(run_worker_step(wc, so, vllm_config, layer_names))
            finally:
                WORKER_RANK.reset(token)
    finally:
        so.kv_connector_metadata = first
    return outs


def add_reported(
    out: KVConnectorOutput,
    finished_sending: Iterable[str],
    finished_recving: Iterable[str],
    failed_recving: Iterable[str],
    invalid_block_ids: Iterable[int],
) -> None:
    """Add completion sets a test gives (as "what the worker reported") to a rank's output."""
    out.finished_sending = set(out.finished_sending or ()) | set(finished_sending)
    out.finished_recving = set(out.finished_recving or ()) | set(finished_recving)
    out.failed_recving = set(out.failed_recving or ()) | set(failed_recving)
    out.invalid_block_ids = set(out.invalid_block_ids or ()) | set(invalid_block_ids)
