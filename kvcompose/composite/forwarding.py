"""Scheduler-side members of a composite node that hold no per-request state.

Each forwards to every child by its rule in ``kvcompose.composite.rules``: events chained,
pending work and block frees if any child has some, bindings to every child, the handshake
sliced per child, the cache reset tri-state, one finished count that all children share.
``CompositeScheduler`` (``scheduler.py``) adds the per-request state on top.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvcompose.composite.children import Children
from kvcompose.composite.metadata import ComposedHandshake

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheManager


class SchedulerForwarding:
    """The node-wide half of ``CompositeScheduler``."""

    def __init__(self, name: str, children: Children, world_size: int) -> None:
        self.name = name
        self.children = children
        self.guard = children.guard
        self._connectors = children.connectors  # read every step: one attribute, not two
        self._call = children.call
        self._world_size = world_size

    # Asked every step: only the children that implement them are called (the base class's
    # own return ``()`` and ``False``, which change nothing; ``Children.implementing``).
    def take_events(self) -> Iterable[KVCacheEvent]:
        call = self._call
        for i in self.children.implementing("take_events"):
            yield from call(i, "take_events", ())

    def has_pending_block_frees(self) -> bool:
        return self.children.any("has_pending_block_frees")

    def has_pending_push_work(self) -> bool:
        return self.children.any("has_pending_push_work")

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self.children.all("bind_kv_cache_manager", kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self.children.all("bind_gpu_block_pool", gpu_block_pool)

    def get_finished_count(self) -> int | None:
        """vLLM asks once at engine start (``EngineCore`` → ``KVOutputAggregator.from_connector``),
        so a conflict refuses to start there."""
        world_size = self._world_size
        counts = {child.name: child.connector.get_finished_count() for child in self.children}
        resolved = {name: world_size if c is None else c for name, c in counts.items()}
        if len(set(resolved.values())) > 1:
            raise ValueError(
                f"kvcompose[{self.name}]: children expect different numbers of finished "
                f"signals per request ({resolved}; None = world size {world_size}); vLLM has "
                "one count for all requests, so these connectors cannot share a composite"
            )
        value = next(iter(resolved.values()), world_size)
        return None if value == world_size else value

    def reset_cache(self) -> bool | None:
        results = [
            self.children.call(i, "reset_cache", False)
            for i in range(len(self.children.connectors))
        ]
        if any(r is False for r in results):
            return False
        if results and all(r is True for r in results):
            return True
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        for i, child in enumerate(self.children.connectors):
            child.set_xfer_handshake_metadata(_handshake_part(metadata, i))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        # Every child hears the call, with its own part or ``{}``: vLLM's EngineCore makes
        # it with ``{}`` when no worker has handshake metadata, and MultiConnector forwards
        # that to every child; NIXL starts its listener only when its part is non-empty.
        for i, child in enumerate(self.children.connectors):
            child.set_xfer_handshake_metadata_pp_aware(_handshake_part(metadata, i))

    @property
    def requires_kv_delivery(self) -> bool:
        return any(c.requires_kv_delivery for c in self.children.connectors)


def _handshake_part(metadata: dict[Any, Any], child: int) -> dict[Any, Any]:
    return {
        k: md.children[child]
        for k, md in metadata.items()
        if isinstance(md, ComposedHandshake) and md.children[child] is not None
    }
