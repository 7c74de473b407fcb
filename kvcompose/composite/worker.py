"""The worker half of a composite node: vLLM's worker-side calls forwarded to the children,
with each child's failures contained, and what the children report filtered on the way up
(``kvcompose.composite.worker_signals.WorkerSignals``).

A child that raises while loading (``start_load_kv``, ``wait_for_layer_load``,
``get_transfer_results``, ``get_block_ids_with_load_errors``) fails its own loads and no
other's: its async loads in flight are reported failed once, its sync loads of the step as
failed blocks. A child's load errors are taken right after its transfer results, so one that
raises while naming its bad blocks has the receives it reported in that step go up failed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from kvcompose.composite.children import Children
from kvcompose.composite.metadata import (
    ComposedHandshake,
    ComposedKVEvents,
    ComposedWorkerMeta,
    CompositeMetadata,
)
from kvcompose.composite.worker_signals import WorkerSignals
from kvcompose.composite.worker_timing import LoadTimer

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext


class CompositeWorker:
    """Worker-side state and methods of one node (built for the WORKER role)."""

    def __init__(self, name: str, children: Children, *, timed: bool = False) -> None:
        self.name = name
        self.children = children
        self.guard = children.guard
        self.timer = LoadTimer() if timed else None  # ``policy: fastest`` times the loads
        self.signals = WorkerSignals(children.guard, self.timer)
        self._savers = [i for i, c in enumerate(children) if c.saves]
        # the children's load errors, taken with their transfer results (None: not this step)
        self._load_errors: set[int] | None = None

    def live(self) -> dict[str, object]:
        return self.signals.live()

    def _all_loading(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Worker calls that load KV: a child that raises fails its own loads, no other's.
        A child's calls in a step it loads sync are timed (``policy: fastest``)."""
        timer = self.timer
        for i, child in enumerate(self.children.connectors):
            started = timer.clock() if timer is not None and timer.loads_sync(i) else None
            try:
                getattr(child, method)(*args, **kwargs)
            except Exception as exc:
                self.signals.fail_loads_of(i)
                self.guard.child_error(i, method, exc)
            if started is not None:
                timer.add_sync(i, timer.clock() - started)  # type: ignore[union-attr]

    def _savers_all(self, method: str, *args: Any, **kwargs: Any) -> None:
        call = self.children.call
        for i in self._savers:
            call(i, method, None, *args, **kwargs)

    # ------------------------------------------------------------------ set-up
    def get_mem_pool_context(self) -> AbstractContextManager | None:
        contexts = [
            (c.name, ctx)
            for c in self.children
            if (ctx := c.connector.get_mem_pool_context()) is not None
        ]
        if len(contexts) > 1:
            raise ValueError(
                f"kvcompose[{self.name}]: children {[n for n, _ in contexts]} each "
                "want their own KV-cache memory pool; at most one can"
            )
        return contexts[0][1] if contexts else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.children.all("register_kv_caches", kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self.children.all("set_host_xfer_buffer_ops", copy_operation)

    def unregister_kv_caches(self) -> None:
        self.children.all("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self.children.all("restore_kv_caches")

    def get_handshake_metadata(self) -> ComposedHandshake | None:
        parts = tuple(c.get_handshake_metadata() for c in self.children.connectors)
        return None if all(p is None for p in parts) else ComposedHandshake(parts)

    # ---------------------------------------------------------------- per step
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, CompositeMetadata)
        for child, md in zip(self.children.connectors, kv_connector_metadata.children, strict=True):
            if md is not None:
                child.handle_preemptions(md)

    def bind_connector_metadata(self, connector_metadata: CompositeMetadata) -> None:
        self.signals.on_metadata(connector_metadata)
        for child, md in zip(self.children.connectors, connector_metadata.children, strict=True):
            if md is not None:
                child.bind_connector_metadata(md)

    def clear_connector_metadata(self) -> None:
        self.children.all("clear_connector_metadata")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._all_loading("start_load_kv", forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._all_loading("wait_for_layer_load", layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._savers_all("save_kv_layer", layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._savers_all("wait_for_save")

    def finish_forward(self) -> None:
        self.children.all("finish_forward")

    def reset_capture_state(self) -> None:
        self.children.all("reset_capture_state")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Each child's transfer results, and right after them its load errors (vLLM's runner
        asks for both in this order, one after the other): a child that raises while naming
        its bad blocks has its receives of this step go up failed, not as good loads whose
        bad blocks were lost with the exception."""
        results: list[KVConnectorTransferResults | None] = []
        errors: list[set[int]] = []
        for i, child in enumerate(self.children.connectors):
            result: KVConnectorTransferResults | None = None
            try:
                result = child.get_transfer_results(finished_req_ids)
            except Exception as exc:
                self.signals.fail_loads_of(i)
                self.guard.child_error(i, "get_transfer_results", exc)
            results.append(result)
            errors.append(self._load_errors_of(i, result))
        combined = self.signals.combine(results, finished_req_ids)
        # claimed as when vLLM asks for the errors after the results: a parked stitch's
        # segment whose round ended this step still claims its own bad blocks
        self._load_errors = self._claim(errors, combined)
        return combined

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, None
        if errors is None:  # not asked with the transfer results this step
            errors = self._claim([self._load_errors_of(i) for i in range(len(self.children))])
        return errors | self.signals.take_failed_blocks()

    def _load_errors_of(self, i: int, result: KVConnectorTransferResults | None = None) -> set[int]:
        """Child ``i``'s bad block ids; if it raises instead, its loads fail, the receives it
        reported this step (``result``) among them."""
        try:
            return set(self.children.connectors[i].get_block_ids_with_load_errors() or ())
        except Exception as exc:
            reporting: set[str] = set()
            if result is not None:
                reporting = result.finished_recving | result.failed_recving
                result.failed_recving = set(reporting)
            self.signals.fail_loads_of(i, reporting)
            self.guard.child_error(i, "get_block_ids_with_load_errors", exc)
            return set()

    def _claim(
        self, errors: list[set[int]], combined: KVConnectorTransferResults | None = None
    ) -> set[int]:
        """What of the children's bad blocks goes up to vLLM (``WorkerSignals.claim_errors``):
        on several KV cache groups none, a child's unclaimed ones failing its loads by request
        instead (``WorkerSignals.fail_by_request``; ``combined``: the step's results, whose
        receives from the child then go up failed)."""
        signals = self.signals
        claimed: set[int] = set()
        for i, mine in enumerate(errors):
            if not mine:
                continue
            left = signals.claim_errors(i, mine)
            if left and signals.by_request:
                signals.fail_by_request(i, combined)
            else:
                claimed |= left
        signals.end_fences()
        return claimed

    def get_kv_connector_kv_cache_events(self) -> ComposedKVEvents | None:
        events = [
            self.children.call(i, "get_kv_connector_kv_cache_events", None)
            for i in range(len(self.children.connectors))
        ]
        return None if all(e is None for e in events) else ComposedKVEvents(events)

    def build_connector_worker_meta(self) -> ComposedWorkerMeta | None:
        parts = tuple(
            self.children.call(i, "build_connector_worker_meta", None)
            for i in range(len(self.children.connectors))
        )
        failures = self.signals.take_segment_failures()
        took = self.timer.take() if self.timer is not None else {}
        if not failures and not took and all(p is None for p in parts):
            return None
        return ComposedWorkerMeta(parts, failures, took)
