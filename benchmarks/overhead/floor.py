"""``FloorConnector``: a bare forwarding composite of no-op children, the line a composite's
own work is measured from."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcompose.testing.noop import NoopConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: The name this module was imported under (``overhead.floor`` with ``benchmarks/`` on
#: ``sys.path``): vLLM imports the connector by it.
MODULE_PATH = __name__


class FloorMetadata(KVConnectorMetadata):
    def __init__(self, children: list[KVConnectorMetadata]) -> None:
        self.children = children


class FloorConnector(KVConnectorBase_V1):
    """A composite over k children written as plainly as possible: every child is asked in
    turn (the first hit owns the load), told its allocation and the step's output, heard at
    the finish, and builds its metadata; no ledger, no guard, no counters, no contract
    checks. What forwarding alone costs, the line a composite's own work is measured from
    (``extra_config: {children: k}``, NoopConnector children). Not a strict lower bound: a
    composite that binds its children's methods once can beat its plain loops."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config  # type: ignore[union-attr]
        self._children = [
            NoopConnector(vllm_config, role, kv_cache_config)
            for _ in range(int(extra.get("children", 2)))
        ]
        self._owner: dict[str, int] = {}

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        for i, child in enumerate(self._children):
            n, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._owner[request.request_id] = i
                return n, is_async
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        owner = self._owner.get(request.request_id)
        for i, child in enumerate(self._children):
            child.update_state_after_alloc(
                request, blocks, num_external_tokens if i == owner else 0
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return FloorMetadata([c.build_connector_meta(scheduler_output) for c in self._children])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for child in self._children:
            child.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        return [event for child in self._children for event in child.take_events()]

    def get_kv_connector_stats(self) -> Any:
        for child in self._children:
            child.get_kv_connector_stats()
        return None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._owner.pop(request.request_id, None)
        delay, params = False, None
        for child in self._children:
            d, p = child.request_finished(request, block_ids)
            delay = delay or d
            if p:
                params = {**(params or {}), **p}
        return delay, params

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for child in self._children:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        for child in self._children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self._children:
            child.wait_for_save()


def floor_config(children: int) -> dict[str, Any]:
    """A vLLM ``KVTransferConfig`` dict for a ``FloorConnector`` over ``children`` no-ops."""
    return {
        "kv_connector": "FloorConnector",
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"children": children},
    }
