"""What a store tells others about the tier it is: its medium, as vLLM's hit source and as
the ``medium`` of the KV cache events it publishes.

vLLM splits ``vllm:prompt_tokens_cached_by_source`` by the connector's
``get_external_cache_hit_sources`` (``CacheHitSource``: HOST, DISK, ...), and a KV-aware
router (llm-d's tier-weighted scorer) reads the ``medium`` of ``BlockStored`` events
(``"CPU"``, ``"STORAGE"``, as vLLM's offloading connectors publish them). A store on tmpfs
is memory, not disk, so the medium is read from the mount unless the config names it.
"""

from __future__ import annotations

import os
from typing import Literal

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

Medium = Literal["cpu", "tmpfs", "disk", "remote"]

#: Medium -> vLLM hit source (``vllm:prompt_tokens_cached_by_source``).
HIT_SOURCE: dict[str, CacheHitSource] = {
    "cpu": CacheHitSource.HOST,
    "tmpfs": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}
#: Medium -> the ``medium`` string of KV cache events (vLLM's own constants).
EVENT_MEDIUM: dict[str, str] = {
    "cpu": MEDIUM_CPU,
    "tmpfs": MEDIUM_CPU,
    "disk": MEDIUM_STORAGE,
    "remote": MEDIUM_STORAGE,
}
_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}


def detect_medium(path: str | os.PathLike[str]) -> Medium:
    """``"tmpfs"`` when ``path`` lies on a memory file system (``/proc/mounts``), else
    ``"disk"``."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return "disk"
    return "tmpfs" if fstype in _MEMORY_FILESYSTEMS else "disk"


class StoreKVEvents(KVConnectorKVEvents):
    """The store's KV cache events, worker to scheduler (as vLLM's LMCache connector's:
    with several workers, only events every worker reported are kept)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> StoreKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()
