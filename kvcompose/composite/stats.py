"""Per-node stats: the composite's own counters and its children's stats, keyed by node name.

Upstream MultiConnector keys child stats by class name, so two children of one class merge, and
rebuilds them in the logger process through vLLM's registry, which fails for plugin connectors.
Here each child's stats travel under its node name together with its class path, and are
rebuilt by importing that class.

Payload (``ComposedStats.data``, what ``to_dict`` returns and the logger process receives)::

    {"node": "tiers",
     "counters": {"lookups": 12, "hits.ram": 3, "hit_tokens.ram": 384, ...},
     "children": {"ram": {"cls": "vllm...:ExampleConnector", "data": {...}}, ...}}
"""

from __future__ import annotations

import importlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


class StatsSource(Protocol):
    """What ``ComposedStats.collect`` reads of a node's children (``Children`` is one)."""

    names: list[str]
    connectors: Sequence[Any]

    def call(self, child: int, method: str, default: Any) -> Any: ...

    def implementing(self, method: str) -> tuple[int, ...]: ...


class NodeCounters:
    """A node's counters since start (``totals``, for the Python API and tests); vLLM's
    periodic stats get what changed since the previous collection (``drain``).

    ``lookups`` is a plain attribute the scheduler half increments inline (it counts every
    decided lookup, on the scheduler's per-request path); ``totals`` shows it under
    ``"lookups"`` once it is non-zero. ``changed`` (any other counter moved) and
    ``drained_lookups`` let the node see without a call that nothing is left to drain."""

    def __init__(self, child_names: list[str]) -> None:
        self.child_names = child_names
        self.lookups = 0
        self.drained_lookups = 0
        self.changed = False
        self._totals: defaultdict[str, float] = defaultdict(int)
        self._drained: dict[str, int] = {}
        self._hit_keys = [(f"hits.{n}", f"hit_tokens.{n}") for n in child_names]
        #: told which child was still looking at a lookup deadline (the guard's ejection)
        self.on_lookup_timeout: Callable[[int], None] | None = None

    @property
    def totals(self) -> defaultdict[str, float]:
        if self.lookups:
            self._totals["lookups"] = self.lookups
        return self._totals

    def inc(self, key: str, n: float = 1) -> None:
        self._totals[key] += n
        self.changed = True

    def lookup(self) -> None:
        self.lookups += 1

    def hit(self, child: int, tokens: int) -> None:
        hits, hit_tokens = self._hit_keys[child]
        totals = self._totals
        totals[hits] += 1
        totals[hit_tokens] += tokens
        self.changed = True

    def plan_hit(self, plan: str, child: int, tokens: int) -> None:
        """``inc(plan)`` and ``hit(child, tokens)`` in one call: ``fastest``'s lookup fast
        path counts its plan of one load so (on the scheduler's per-request path)."""
        hits, hit_tokens = self._hit_keys[child]
        totals = self._totals
        totals[plan] += 1
        totals[hits] += 1
        totals[hit_tokens] += tokens
        self.changed = True

    def lookup_timeout(self, child: int) -> None:
        self.inc(f"lookup_timeouts.{self.child_names[child]}")
        if self.on_lookup_timeout is not None:
            self.on_lookup_timeout(child)

    def drain(self) -> dict[str, int]:
        """Counts since the previous ``drain``."""
        previous = self._drained
        totals = self.totals
        self.changed, self.drained_lookups = False, self.lookups
        if totals == previous:
            return {}
        out = {k: v - previous.get(k, 0) for k, v in totals.items() if v != previous.get(k, 0)}
        self._drained = dict(totals)
        return out


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _rebuild(path: str, data: dict[str, Any]) -> KVConnectorStats | None:
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls.build_kv_connector_stats(data)


@dataclass
class ComposedStats(KVConnectorStats):
    @classmethod
    def collect(
        cls, node: str, children: StatsSource, counters: NodeCounters
    ) -> ComposedStats | None:
        """Node ``node``'s stats since the last collection; None when there are none."""
        by_child: dict[str, dict[str, Any]] = {}
        # a child that inherits the base method has no stats (it returns None)
        for i in children.implementing("get_kv_connector_stats"):
            stats = children.call(i, "get_kv_connector_stats", None)
            if stats is not None and not stats.is_empty():
                by_child[children.names[i]] = {
                    "cls": class_path(type(children.connectors[i])),
                    "data": stats.to_dict(),
                }
        drained = counters.drain()
        if not drained and not by_child:
            return None
        return cls(data={"node": node, "counters": drained, "children": by_child})

    @property
    def counters(self) -> dict[str, int]:
        return self.data.setdefault("counters", {})

    @property
    def children(self) -> dict[str, dict[str, Any]]:
        return self.data.setdefault("children", {})

    def reset(self) -> None:
        self.data = {"node": self.data.get("node"), "counters": {}, "children": {}}

    def aggregate(self, other: KVConnectorStats) -> ComposedStats:
        assert isinstance(other, ComposedStats)
        counters = Counter(self.counters)
        counters.update(other.counters)
        children = dict(self.children)
        for name, entry in other.children.items():
            mine = children.get(name)
            if mine is None:
                children[name] = entry
                continue
            rebuilt = _rebuild(mine["cls"], mine["data"])
            theirs = _rebuild(entry["cls"], entry["data"])
            if rebuilt is None or theirs is None:
                children[name] = entry
            else:
                children[name] = {"cls": mine["cls"], "data": rebuilt.aggregate(theirs).to_dict()}
        node = self.data.get("node") or other.data.get("node")
        return ComposedStats(data={"node": node, "counters": dict(counters), "children": children})

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.counters)
        for name, entry in self.children.items():
            stats = _rebuild(entry["cls"], entry["data"])
            if stats is None:
                continue
            try:
                reduced = stats.reduce()
            except NotImplementedError:
                continue
            for key, value in reduced.items():
                out[f"{name}.{key}"] = value
        return out

    def is_empty(self) -> bool:
        if any(self.counters.values()):
            return False
        for entry in self.children.values():
            stats = _rebuild(entry["cls"], entry["data"])
            if stats is None or not stats.is_empty():
                return False
        return True


#: kvcompose's own Prometheus counters: (counter key prefix, metric name, extra labels, help).
PROM_COUNTERS = (
    ("lookups", "vllm:kvcompose_lookups", (), "Lookups decided by a kvcompose node."),
    ("hits", "vllm:kvcompose_hits", ("child",), "Loads a kvcompose node gave to a child."),
    (
        "hit_tokens",
        "vllm:kvcompose_hit_tokens",
        ("child",),
        "Tokens a kvcompose node's children were chosen to load.",
    ),
    (
        "reloads",
        "vllm:kvcompose_reloads",
        ("child",),
        "Failed stitch segments a kvcompose node's children reloaded.",
    ),
    (
        "reloaded_tokens",
        "vllm:kvcompose_reloaded_tokens",
        ("child",),
        "Tokens of failed stitch segments a kvcompose node's children reloaded.",
    ),
    (
        "plans",
        "vllm:kvcompose_plans",
        ("kind",),
        "Plans a `fastest` kvcompose node chose, by kind (recompute, load, stitch).",
    ),
    (
        "load_seconds_predicted",
        "vllm:kvcompose_load_seconds_predicted",
        ("child",),
        "Seconds a `fastest` kvcompose node predicted for its children's timed loads.",
    ),
    (
        "load_seconds_actual",
        "vllm:kvcompose_load_seconds_actual",
        ("child",),
        "Seconds its children's timed loads took, as a `fastest` kvcompose node measured.",
    ),
    (
        "lookup_timeouts",
        "vllm:kvcompose_lookup_timeouts",
        ("child",),
        "Children still answering None at a kvcompose node's lookup deadline.",
    ),
    (
        "ejections",
        "vllm:kvcompose_ejections",
        ("child",),
        "Times a kvcompose node ejected a child from lookups (its `eject` rule).",
    ),
    (
        "ejected_lookups",
        "vllm:kvcompose_ejected_lookups",
        ("child",),
        "Lookups a kvcompose node skipped an ejected child in.",
    ),
    (
        "slow_lookups",
        "vllm:kvcompose_slow_lookups",
        ("child",),
        "Lookups slower than the child's `eject.slow_ms` (each counts as a failure).",
    ),
    (
        "readmissions",
        "vllm:kvcompose_readmissions",
        ("child",),
        "Ejected children a kvcompose node let back into lookups after a trial in time.",
    ),
    (
        "violations",
        "vllm:kvcompose_contract_violations",
        ("child", "kind"),
        "vLLM connector-contract violations by a kvcompose node's children.",
    ),
    (
        "errors",
        "vllm:kvcompose_child_errors",
        ("child", "where"),
        "Exceptions raised by a kvcompose node's children.",
    ),
)


def split_counter(key: str) -> tuple[str, tuple[str, ...]]:
    """``"hits.ram"`` → ``("hits", ("ram",))``; ``"violations.ram.zero_async"`` →
    ``("violations", ("ram", "zero_async"))``."""
    prefix, _, rest = key.partition(".")
    if not rest:
        return prefix, ()
    if prefix in ("violations", "errors"):
        child, _, kind = rest.rpartition(".")
        return prefix, (child, kind)
    return prefix, (rest,)


class ComposedPromMetrics(KVConnectorPromMetrics):
    """kvcompose's counters with a ``node`` label (plus ``child``/``kind`` where they apply),
    and the children's own metrics, one set per child class (registered once even when
    several nodes share a class), each fed with its node's data."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        by_class: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._by_class = by_class
        self._counters = {
            prefix: self._counter_cls(
                name=name, documentation=doc, labelnames=[*labelnames, "node", *extra]
            )
            for prefix, name, extra, doc in PROM_COUNTERS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._observe(transfer_stats_data, engine_idx)

    def _observe(self, data: dict[str, Any], engine_idx: int) -> None:
        engine_labels = self.per_engine_labelvalues[engine_idx]
        node = data.get("node") or ""
        for key, value in data.get("counters", {}).items():
            prefix, extra = split_counter(key)
            counter = self._counters.get(prefix)
            if counter is not None and value:
                counter.labels(*engine_labels, node, *extra).inc(value)
        for name, entry in data.get("children", {}).items():
            metrics = self._by_class.get(entry["cls"])
            observe_node = getattr(metrics, "observe_node", None)
            if observe_node is not None:  # per-node labels (kvcompose's stores: ``tier``)
                observe_node(name, entry["data"], engine_idx)
            elif metrics is not None:
                metrics.observe(entry["data"], engine_idx)
            elif "counters" in entry["data"]:  # a nested composite
                self._observe(entry["data"], engine_idx)


def build_composed_prom_metrics(
    leaf_classes: Iterable[tuple[type, Any]],
    vllm_config: Any,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> ComposedPromMetrics:
    """``leaf_classes``: every leaf connector class of the tree with its ``VllmConfig``."""
    by_class: dict[str, KVConnectorPromMetrics] = {}
    for leaf_cls, leaf_config in leaf_classes:
        path = class_path(leaf_cls)
        if path in by_class:
            continue
        metrics = leaf_cls.build_prom_metrics(
            leaf_config,
            metric_types,
            labelnames,  # type: ignore[attr-defined]
            per_engine_labelvalues,
        )
        if metrics is not None:
            by_class[path] = metrics
    return ComposedPromMetrics(
        vllm_config, metric_types, labelnames, per_engine_labelvalues, by_class
    )
