"""What the scheduler half tells the workers each step (vLLM's ``KVConnectorMetadata``).

The scheduler plans in vLLM's (manager) block ids and chunk keys only; the workers never
hash tokens or look at requests, so a step's metadata is the whole contract between the
two halves.

Under several KV cache groups (vLLM's hybrid KV cache manager) every chunk is loaded and
saved per group, by each group's own block ids (``groups``); the single-group fields hold
group 0's, so code that knows one group keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkLoad:
    """Load part of one stored chunk into a request's blocks."""

    key: str
    #: Offset, in vLLM blocks, of the first loaded block inside the chunk file (non-zero
    #: when the engine's local prefix cache already holds the chunk's first blocks).
    first_block: int
    #: The request's (manager) block ids that receive the chunk's blocks ``first_block``,
    #: ``first_block + 1``, ...
    block_ids: list[int]
    num_tokens: int
    #: Several KV cache groups: ``(first_block, block_ids)`` per group (a windowed group's
    #: start later: only its window is loaded). None: one group, the fields above.
    groups: list[tuple[int, list[int]]] | None = None

    def for_group(self, group: int) -> ChunkLoad:
        """The part of the load one group's layers receive (itself under one group)."""
        if self.groups is None:
            return self
        first_block, block_ids = self.groups[group]
        return ChunkLoad(self.key, first_block, block_ids, self.num_tokens)


@dataclass
class LoadSpec:
    """One request's load: its chunks in prefix order."""

    req_id: str
    chunks: list[ChunkLoad]
    #: Reported through ``finished_recving``/``failed_recving`` (async) or, on failure,
    #: through the blocks of ``get_block_ids_with_load_errors`` (sync).
    is_async: bool
    num_tokens: int

    @property
    def block_ids(self) -> list[int]:
        return [b for c in self.chunks for b in c.block_ids]


@dataclass
class SaveSpec:
    """Save one full chunk from a request's blocks."""

    key: str
    block_ids: list[int]
    num_tokens: int
    req_id: str
    #: The ``BlockStored`` KV cache event to publish once written (None: events off).
    event: Any = None
    #: Several KV cache groups: the chunk's block ids per group. None: one group,
    #: ``block_ids``.
    groups: list[list[int]] | None = None

    def blocks_of(self, group: int) -> list[int]:
        """The chunk's block ids in one group."""
        return self.block_ids if self.groups is None else self.groups[group]


@dataclass
class PrefixStoreMetadata(KVConnectorMetadata):
    """One step's loads and saves (saves in prefix order), and, for the background writer,
    the requests whose blocks are held until their saves are written (``finished_saves``)
    and the requests whose blocks were freed by a preemption (``preempted``)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    finished_saves: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class StoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker to scheduler: background writes finished since the last step, by key."""

    written: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StoreWorkerMeta:
        # Several workers: a chunk counts as written once every worker wrote its file
        # (lookups check the files then); any worker's drop withdraws the offer.
        if isinstance(other, StoreWorkerMeta):
            self.written |= other.written
            self.dropped |= other.dropped
        return self
