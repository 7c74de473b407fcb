"""``NoopConnector``: a real vLLM connector that does nothing, a child for tests of the
plumbing around connectors (and for the scheduler-overhead benchmark).

Every lookup misses (``(0, False)``), metadata is empty, nothing is loaded or saved. It writes
the methods vLLM's base class leaves abstract and ``request_finished``, and inherits the rest
(``on_new_request``, ``take_events``...). Load it with::

    {"kv_connector": "NoopConnector", "kv_connector_module_path": "kvcompose.testing.noop",
     "kv_role": "kv_both"}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

MODULE_PATH = "kvcompose.testing.noop"


class NoopMetadata(KVConnectorMetadata):
    pass


class NoopConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return NoopMetadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return


def noop_config(name: str = "noop") -> dict[str, Any]:
    """A vLLM ``KVTransferConfig`` dict for one no-op connector."""
    return {
        "kv_connector": "NoopConnector",
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
    }
