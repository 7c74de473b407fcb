"""vLLM's real scheduler with 2 KV cache groups (the hybrid model: a sliding-window group and
a full-attention group), for the store's scheduler-level tests.

``SchedulerHarness`` over the hybrid model forms the groups from the model's ``layer_types``
(the store supports HMA, so vLLM keeps it on). The worker's caches are registered as the
engine lays them out under HMA: one tensor per pair of layers, shared by a sliding layer and
a full one (a block id belongs to one group at a time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvcompose.engine.harness import SchedulerHarness
from kvcompose.testing import faulty_store

BLOCK = 32
NUM_BLOCKS = 96


def store_transfer_config(path: Path, connector: str = "PrefixStoreConnector", **store: Any):
    """The store (or its fault-injecting double, ``connector=faulty_store.CONNECTOR``)."""
    module = "kvcompose.stores" if connector == "PrefixStoreConnector" else faulty_store.MODULE_PATH
    return {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(path), **store},
    }


def hybrid_harness(
    model_dir: Path, kv_transfer_config: dict[str, Any], **kw: Any
) -> SchedulerHarness:
    """A harness over the hybrid model with 2 KV cache groups and the store's worker half
    running on registered caches (``h.caches``: layer name -> its tensor)."""
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", NUM_BLOCKS)
    kw.setdefault("enable_prefix_caching", False)
    h = SchedulerHarness(model_dir, kv_transfer_config, with_worker=True, **kw)
    groups = h.kv_cache_config.kv_cache_groups
    assert len(groups) == 2, groups
    caches: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    sliding, full = (sorted(g.layer_names) for g in sorted(groups, key=_is_full))
    for a, b in zip(sliding, full, strict=True):
        shared = torch.randn(h.num_blocks, 2, BLOCK, 4, 32, generator=gen)
        caches[a] = caches[b] = shared
    h.worker_connector.register_kv_caches(caches)
    h.caches = caches  # type: ignore[attr-defined]
    return h


def _is_full(group: Any) -> bool:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return not isinstance(group.kv_cache_spec, SlidingWindowSpec)


def group_index(h: SchedulerHarness, sliding: bool) -> int:
    """The index of the sliding-window (or the full-attention) group."""
    for i, g in enumerate(h.kv_cache_config.kv_cache_groups):
        if _is_full(g) != sliding:
            return i
    raise AssertionError("no such group")


def layers_of(h: SchedulerHarness, group: int) -> list[str]:
    return sorted(h.kv_cache_config.kv_cache_groups[group].layer_names)
