"""``NoopConnector``: a real vLLM connector that does nothing, a child for tests of the
plumbing around connectors (and for the scheduler-overhead benchmark).

By default every lookup misses (``(0, False)``): what a connector costs when it has nothing,
the plumbing alone, which is what the tests and the overhead benchmark's ``direct``,
``multiconnector-k`` and ``kvcompose-k`` configurations measure. Metadata is empty, nothing is
loaded or saved. It writes the methods vLLM's base class leaves abstract and
``request_finished``, and inherits the rest (``on_new_request``, ``take_events``...). Load it
with::

    {"kv_connector": "NoopConnector", "kv_connector_module_path": "kvcompose.testing.noop",
     "kv_role": "kv_both"}

``kv_connector_extra_config: {hit_tokens: N}`` makes it claim to hold the first ``N`` tokens of
every prompt, so that a composite's policies have hits to choose between (the overhead
benchmark's ``longest-k``/``fastest-k``): see ``get_num_new_matched_tokens``. Nothing is loaded
even then; the hit is sync, so vLLM's scheduler counts its tokens computed at once, which is
all a scheduler-side harness with no worker (``kvcompose.engine.harness.SchedulerHarness``)
needs.
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
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config if ktc is not None else None) or {}
        #: the prompt prefix every lookup claims to hold (0: every lookup misses)
        self.hit_tokens = int(extra.get("hit_tokens", 0))
        self.block_size = vllm_config.cache_config.block_size
        if self.hit_tokens > 0:
            # bound here so that the default miss costs what it always did
            self.get_num_new_matched_tokens = self._hit  # type: ignore[method-assign]

    # scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def _hit(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` with ``hit_tokens``: a sync hit up to the first
        ``hit_tokens`` tokens, at most all but the prompt's last token (``Scheduler.schedule``
        asserts a sync load leaves at least one to compute), cut down to a block boundary (a
        connector loads whole blocks), less what is computed already; else a miss."""
        end = min(self.hit_tokens, request.num_tokens - 1)
        new = end - end % self.block_size - num_computed_tokens
        return (new, False) if new > 0 else (0, False)

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


def noop_config(name: str = "noop", hit_tokens: int = 0) -> dict[str, Any]:
    """A vLLM ``KVTransferConfig`` dict for one no-op connector (``hit_tokens``: see the
    module docstring)."""
    out: dict[str, Any] = {
        "kv_connector": "NoopConnector",
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
    }
    if hit_tokens:
        out["kv_connector_extra_config"] = {"hit_tokens": hit_tokens}
    return out
