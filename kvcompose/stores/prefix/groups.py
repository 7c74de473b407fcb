"""The engine's KV cache groups as the store sees them: which layer belongs to which group,
and which groups keep only a window of blocks.

Under vLLM's hybrid KV cache manager (HMA) a model with several attention types has one KV
cache group per type (``KVCacheConfig.kv_cache_groups``), and every group has its own block
ids for the same request. A sliding-window or chunked-local group keeps only the blocks its
attention still reads: the blocks before the window are vLLM's null block
(``BlockPool.null_block``, block id 0), in the request's block table from the first
allocation (``SingleTypeKVCacheManager.add_local_computed_blocks`` pads the skipped ones) or
once the request moves past them (``remove_skipped_blocks``). The store therefore plans every
load and save per group, by that group's own block ids, and never touches a null block.

A chunk file still holds every layer's blocks of its tokens (the store saves a chunk only
while every group still holds all of its blocks), so a chunk is a hit at its boundary for
every group; a load reads, per group, only the blocks vLLM allocated, which for a windowed
group is the window before the load's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: vLLM's null block (``BlockPool.null_block`` is the first block of the pool).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class KVGroups:
    """Layer name -> group index, and per group whether it keeps a window only."""

    layer_group: dict[str, int]
    #: Per group: True when vLLM frees its blocks before the window (sliding window,
    #: chunked local attention) while the request runs.
    windowed: tuple[bool, ...]

    @classmethod
    def single(cls) -> KVGroups:
        """One full-attention group (a config without groups: unit tests, doubles)."""
        return cls({}, (False,))

    @classmethod
    def of(cls, kv_cache_config: Any) -> KVGroups:
        """The groups of vLLM's ``KVCacheConfig``; raises ``ValueError`` for a group whose
        blocks are not per token (Mamba state, cross attention) under several groups."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return cls.single()
        layer_group: dict[str, int] = {}
        windowed: list[bool] = []
        for i, group in enumerate(groups):
            for name in getattr(group, "layer_names", None) or ():
                layer_group[name] = i
            windowed.append(_windowed(getattr(group, "kv_cache_spec", None), i, len(groups)))
        return cls(layer_group, tuple(windowed))

    @property
    def count(self) -> int:
        return len(self.windowed)

    @property
    def several(self) -> bool:
        return self.count > 1

    def group_of(self, layer: str) -> int:
        return self.layer_group.get(layer, 0)


def _windowed(spec: Any, index: int, count: int) -> bool:
    if spec is None:
        return False
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind in (SlidingWindowSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec):
        return True
    if kind in (FullAttentionSpec, MLAAttentionSpec) or count == 1:
        # One group of any kind is stored as the store always did.
        return False
    raise ValueError(
        f"PrefixStoreConnector: KV cache group {index} is a {kind.__name__}; under several "
        "groups the store handles full-attention, sliding-window and chunked-local groups"
    )


def window_blocks(block_ids: Sequence[int]) -> tuple[int, list[int]]:
    """``(offset, ids)``: the blocks after the last null block of ``block_ids`` and where
    they start in it (a windowed group's nulls precede its window)."""
    start = 0
    for i, block in enumerate(block_ids):
        if block == NULL_BLOCK_ID:
            start = i + 1
    return start, list(block_ids[start:])


def all_real(block_ids: Sequence[int]) -> bool:
    """No null block among ``block_ids``."""
    return NULL_BLOCK_ID not in block_ids
