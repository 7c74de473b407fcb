"""The store's counters, as vLLM ``KVConnectorStats``.

vLLM collects a worker's stats every step, sums them across workers and intervals with
``aggregate`` and logs ``reduce()``; kvcompose composites nest them per node. The counters
are plain numbers in ``data`` so the stats survive vLLM's serialization between processes.
Under several KV cache groups the bytes are also counted per group
(``bytes_loaded_group<i>``, ``bytes_saved_group<i>``; absent with one group).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

STAT_KEYS: tuple[str, ...] = (
    "chunks_loaded",
    "tokens_loaded",
    "bytes_loaded",
    "chunks_saved",
    "tokens_saved",
    "bytes_saved",
    "load_failures",
    "load_time_s",
    "emulated_wait_s",
    "save_time_s",
    "saves_dropped",
    "evictions",
    "admits",
    "rejects",
    "promotions",
    "occupancy_chunks",
    "occupancy_bytes",
)
#: Prefixes of the per-group byte counters (``<prefix><group index>``).
GROUP_KEY_PREFIXES: tuple[str, ...] = ("bytes_loaded_group", "bytes_saved_group")
#: Levels, not counts: combining two intervals keeps the later non-zero value.
GAUGE_KEYS: frozenset[str] = frozenset({"occupancy_chunks", "occupancy_bytes"})


def _zero_stats() -> dict[str, int | float]:
    return {k: (0.0 if k.endswith("_s") else 0) for k in STAT_KEYS}


@dataclass
class PrefixStoreStats(KVConnectorStats):
    """Counters of one interval; ``aggregate`` sums them (workers, intervals)."""

    def __post_init__(self) -> None:
        merged = _zero_stats()
        merged.update(self.data or {})
        self.data = merged

    def reset(self) -> None:
        self.data = _zero_stats()

    def add(self, **counts: int | float) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v

    def set_level(self, **levels: int) -> None:
        """Record gauges (``occupancy_*``): the latest value, not a sum."""
        self.data.update(levels)

    def aggregate(self, other: KVConnectorStats) -> PrefixStoreStats:
        for k, v in (other.data or {}).items():
            if not isinstance(v, int | float):
                continue
            if k in GAUGE_KEYS:
                if v:
                    self.data[k] = v
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k in STAT_KEYS:
            v = self.data.get(k, 0)
            out[k] = round(v, 4) if isinstance(v, float) else v
        for k in sorted(self.data):
            if k.startswith(GROUP_KEY_PREFIXES):
                out[k] = self.data[k]
        return out

    def bytes_by_group(self, what: str = "loaded") -> dict[int, int]:
        """Group index -> bytes ``loaded`` or ``saved`` (empty with one KV cache group)."""
        prefix = f"bytes_{what}_group"
        return {
            int(k[len(prefix) :]): int(v)
            for k, v in self.data.items()
            if k.startswith(prefix) and k[len(prefix) :].isdigit()
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in STAT_KEYS)

    def snapshot(self) -> dict[str, int | float]:
        return dict(self.data)


class StoreCounters:
    """One worker's counters: this interval's (taken by vLLM each step) and the totals
    since start (tests, benchmarks; never reset). The background writer records too, hence
    the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.interval = PrefixStoreStats()
        self.total = PrefixStoreStats()

    def add(self, **counts: int | float) -> None:
        with self.lock:
            self.interval.add(**counts)
            self.total.add(**counts)

    def set_level(self, **levels: int) -> None:
        with self.lock:
            self.interval.set_level(**levels)
            self.total.set_level(**levels)

    def take_interval(self) -> PrefixStoreStats | None:
        """This interval's counters (then reset), or None when nothing happened."""
        with self.lock:
            if self.interval.is_empty():
                return None
            out = PrefixStoreStats(data=self.interval.snapshot())
            self.interval.reset()
            return out
