"""The worker half of ``SchedulerHarness``: the WORKER-role connector, made as EngineCore
makes it, and driven through one step the way vLLM's model runner drives it (no model, no KV
caches: for connectors whose worker half needs no tensors, such as the scripted doubles)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput


def make_worker_connector(vllm_config: Any, kv_cache_config: Any, scheduler_connector: Any) -> Any:
    """The WORKER-role connector of ``vllm_config``, its handshake metadata handed to the
    scheduler side as EngineCore does at start-up."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    worker = KVConnectorFactory.create_connector(
        config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
    )
    # No KV caches are registered (there is no model), so connectors that need them cannot
    # run a worker here.
    # As EngineCore at start-up (``v1/engine/core.py``, after the output aggregator): the
    # workers' handshake metadata, keyed by (pp_rank, tp_rank), goes to the scheduler side;
    # when no worker has any the call still comes, with {}. (Without a worker there is
    # nothing to report, and EngineCore makes no call.)
    handshake = worker.get_handshake_metadata()
    scheduler_connector.set_xfer_handshake_metadata_pp_aware(
        {} if handshake is None else {(0, 0): handshake}
    )
    return worker


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
