"""Objects a composite ships between its scheduler and worker instances.

Each wraps one object per child (``None`` where a child has none), so a child always sees
exactly what it produced, whatever the nesting depth. They are picklable dataclasses: vLLM
ships them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class CompositeMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step.

    ``loads``: async loads handed out this step, request id → owner child index; the worker
    forwards that child's ``finished_recving``/``failed_recving`` for the request, once.
    ``sync_loads``: sync loads of this step, request id → (owner, block ids the load writes);
    if the owner raises on the worker, those blocks are reported as failed loads.
    ``sends``: requests finished this step whose blocks stay alive, request id → the children
    that asked to delay the free; the worker reports ``finished_sending`` once all of them did.
    ``stitches``: stitched loads vLLM parked this step (``StitchLoad``): the worker reports one
    ``finished_recving`` once every async segment did. ``sync_segments``: the sync segments of
    stitched loads of this step, request id → ((child, block ids), ...).
    ``block_level_failures``: a failed segment may be reported as invalid blocks (vLLM keeps
    the valid prefix before it); False on models with several KV cache groups, where vLLM
    refuses invalid blocks and the request is reported failed (``failed_recving``).
    """

    children: tuple[KVConnectorMetadata | None, ...]
    loads: dict[str, int] = field(default_factory=dict)
    sync_loads: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    sends: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stitches: dict[str, StitchLoad] = field(default_factory=dict)
    sync_segments: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = field(default_factory=dict)
    block_level_failures: bool = True


@dataclass(frozen=True)
class StitchLoad:
    """A parked stitched load: the children whose async segments the worker waits for, and
    every active segment's blocks (for reporting a failed one)."""

    waits: tuple[int, ...]
    blocks: dict[int, tuple[int, ...]]


@dataclass
class ComposedWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, aggregated across workers child by child.

    ``failed_segments``: stitched loads signalled this step whose segments failed, request id
    → the failed children (vLLM reads failures before the scheduler side sees them, so the
    worker tells which segment it was)."""

    children: tuple[KVConnectorWorkerMetadata | None, ...]
    failed_segments: dict[str, frozenset[int]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ComposedWorkerMeta)
        failed = dict(self.failed_segments)
        for req_id, children in other.failed_segments.items():
            failed[req_id] = failed.get(req_id, frozenset()) | children
        merged = []
        for mine, theirs in zip(self.children, other.children, strict=True):
            if mine is None:
                merged.append(theirs)
            elif theirs is None:
                merged.append(mine)
            else:
                merged.append(mine.aggregate(theirs))
        return ComposedWorkerMeta(tuple(merged), failed)


@dataclass
class ComposedHandshake(KVConnectorHandshakeMetadata):
    """One handshake payload per child (upstream MultiConnector keeps only the first)."""

    children: tuple[KVConnectorHandshakeMetadata | None, ...]


class ComposedKVEvents(KVConnectorKVEvents):
    """Each child's worker-side KV-cache events, kept apart.

    vLLM's output aggregator merges workers through ``get_all_events``/``add_events``; events
    travel tagged with their child index so each scheduler-side child gets back only its own.
    """

    def __init__(self, children: list[KVConnectorKVEvents | None]) -> None:
        self.children = children

    def add_events(self, events: list[Any]) -> None:
        for child, event in events:
            target = self.children[child]
            if target is not None:
                target.add_events([event])

    def aggregate(self) -> ComposedKVEvents:
        return ComposedKVEvents([c.aggregate() if c is not None else None for c in self.children])

    def increment_workers(self, count: int = 1) -> None:
        for child in self.children:
            if child is not None:
                child.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return [
            (i, e) for i, c in enumerate(self.children) if c is not None for e in c.get_all_events()
        ]

    def get_number_of_workers(self) -> int:
        return max((c.get_number_of_workers() for c in self.children if c is not None), default=0)

    def clear_events(self) -> None:
        for child in self.children:
            if child is not None:
                child.clear_events()
