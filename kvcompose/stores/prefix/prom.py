"""The store's Prometheus metrics: per tier, what it loaded, saved, dropped, evicted,
admitted, rejected and promoted, and how full it is.

vLLM builds one metrics object per connector class (``build_prom_metrics``) and feeds it
the stats' ``data`` each logging interval. Under a kvcompose tree several stores share the
class, so kvcompose hands each store's data over with its node name
(:meth:`PrefixStorePromMetrics.observe_node`), which becomes the ``tier`` label; a store
used directly gets ``tier=""``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvcompose.stores.prefix.stats import GAUGE_KEYS, STAT_KEYS

_HELP = {
    "chunks_loaded": "Chunks a kvcompose store loaded.",
    "tokens_loaded": "Tokens a kvcompose store loaded.",
    "bytes_loaded": "Bytes a kvcompose store loaded.",
    "chunks_saved": "Chunks a kvcompose store wrote.",
    "tokens_saved": "Tokens a kvcompose store wrote.",
    "bytes_saved": "Bytes a kvcompose store wrote.",
    "load_failures": "Loads of a kvcompose store that failed.",
    "load_time_s": "Seconds a kvcompose store spent loading.",
    "emulated_wait_s": (
        "Seconds a kvcompose store slept to emulate a slower tier (emulate_read; included "
        "in load_time_s)."
    ),
    "save_time_s": "Seconds a kvcompose store spent writing (in the step or its writer).",
    "saves_dropped": "Saves a kvcompose store dropped (writer queue full, preemption).",
    "evictions": "Chunk files a kvcompose store evicted to stay within its capacity.",
    "admits": "Saves a kvcompose store's admission rule accepted.",
    "rejects": "Saves a kvcompose store's admission rule rejected.",
    "promotions": "Chunks another tier loaded that a kvcompose store saved (promotion).",
    "occupancy_chunks": "Chunk files a kvcompose store holds (after its last eviction pass).",
    "occupancy_bytes": "Bytes a kvcompose store holds (after its last eviction pass).",
}


def metric_name(key: str) -> str:
    suffix = "" if key in GAUGE_KEYS or key.endswith("_s") else "_total"
    return f"vllm:kvcompose_store_{key}{suffix}"


class PrefixStorePromMetrics(KVConnectorPromMetrics):
    """Counters (gauges for occupancy) labelled by engine and ``tier``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for key in STAT_KEYS:
            cls = self._gauge_cls if key in GAUGE_KEYS else self._counter_cls
            self._metrics[key] = cls(
                name=metric_name(key),
                documentation=_HELP.get(key, key),
                labelnames=[*labelnames, "tier"],
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.observe_node("", transfer_stats_data, engine_idx)

    def observe_node(self, tier: str, data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [*self.per_engine_labelvalues[engine_idx], tier]
        for key, value in data.items():
            metric = self._metrics.get(key)
            if metric is None or not isinstance(value, int | float):
                continue
            if key in GAUGE_KEYS:
                if value:
                    metric.labels(*labels).set(value)
            elif value:
                metric.labels(*labels).inc(value)
