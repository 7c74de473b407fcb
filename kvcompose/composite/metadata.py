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

    ``loads``: async loads handed out this step, request id → (owner child index, block ids
    the load writes); the worker forwards that child's ``finished_recving``/``failed_recving``
    for the request, once, and fences the blocks if it fails the load for the child's raise.
    ``sync_loads``: sync loads of this step, request id → (owner, block ids the load writes);
    if the owner raises on the worker, those blocks are reported as failed loads.
    ``sends``: requests finished this step whose blocks stay alive, request id → the children
    that asked to delay the free; the worker reports ``finished_sending`` once all of them did.
    ``stitches``: stitched loads vLLM parked this step, and the next rounds of parked stitched
    loads recovering from a failed segment (``StitchLoad``): the worker reports one
    ``finished_recving`` per round once every async segment of it did. ``sync_segments``: the
    sync segments of stitched loads of this step, request id → ((child, block ids), ...).
    ``invalid_blocks``: blocks the worker reports as failed loads this step (a sync stitched
    load's range that no segment loads: an uncuttable segment straddled the grant's end).
    ``by_request``: the model has several KV cache groups, where vLLM takes no invalid block
    ids: the worker fails a child's loads by request when the child names bad blocks.
    """

    children: tuple[KVConnectorMetadata | None, ...]
    loads: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    sync_loads: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    sends: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stitches: dict[str, StitchLoad] = field(default_factory=dict)
    sync_segments: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = field(default_factory=dict)
    invalid_blocks: tuple[int, ...] = ()
    by_request: bool = False


@dataclass(frozen=True)
class StitchLoad:
    """One round of a parked stitched load: the children whose async segments the worker
    waits for, and each of the round's segments' blocks (so that a failure reported as
    blocks is traced to its segment). With the round's one ``finished_recving`` the worker
    reports ``invalid`` as failed blocks, and the request in ``failed_recving`` if
    ``failed``: what the scheduler half gave up (``LoadRecord.lost_from``).

    A segment's failure is not shown to vLLM: the worker reports it in
    ``ComposedWorkerMeta.failed_segments`` and the scheduler half plans the next round."""

    waits: tuple[int, ...]
    blocks: dict[int, tuple[int, ...]]
    invalid: tuple[int, ...] = ()
    failed: bool = False


@dataclass
class ComposedWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, aggregated across workers child by child.

    ``failed_segments``: parked stitched loads whose segments failed this step, request id →
    the failed children (hidden from vLLM, which reads failures before the scheduler half
    sees them: the scheduler half decides what vLLM is told, see ``StitchLoad``).
    ``load_seconds``: (request id, child) → the seconds a load took (``policy: fastest``,
    ``kvcompose.composite.worker_timing``); across workers the slowest rank's, since the load
    is done when every rank has it."""

    children: tuple[KVConnectorWorkerMetadata | None, ...]
    failed_segments: dict[str, frozenset[int]] = field(default_factory=dict)
    load_seconds: dict[tuple[str, int], float] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ComposedWorkerMeta)
        failed = dict(self.failed_segments)
        for req_id, children in other.failed_segments.items():
            failed[req_id] = failed.get(req_id, frozenset()) | children
        seconds = dict(self.load_seconds)
        for key, took in other.load_seconds.items():
            seconds[key] = max(seconds.get(key, 0.0), took)
        merged = []
        for mine, theirs in zip(self.children, other.children, strict=True):
            if mine is None:
                merged.append(theirs)
            elif theirs is None:
                merged.append(mine)
            else:
                merged.append(mine.aggregate(theirs))
        return ComposedWorkerMeta(tuple(merged), failed, seconds)


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
