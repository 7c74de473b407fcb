"""Counters of a running engine's connectors (runs inside the engine process).

Scheduler side: every kvcompose node's counters (lookups, ``hits.<child>``,
``hit_tokens.<child>``, guard counters). Worker side: every PrefixStoreConnector's
``total_stats`` (tokens/chunks/bytes loaded and saved). vLLM's MultiConnector keeps no lookup
counters; its children are named after their stores.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvcompose.bench.results import ConnectorSnapshot, SnapshotNode
from kvcompose.engine import probe

logger = logging.getLogger(__name__)


def _counters(node: Any) -> dict[str, float]:
    counters = getattr(node, "counters", None)
    totals = getattr(counters, "totals", None)
    return dict(totals) if totals is not None else dict(counters or {})


def flush_store_writers(timeout_s: float = 60.0) -> None:
    """Wait until every background store writer in the worker's tree has written what it
    queued. Its writes are counted as the thread writes them, so a snapshot taken right
    after the last request finished would miss that request's saves."""
    try:
        worker_root = probe.worker_connector()
    except Exception:
        return
    for node in probe.walk_connectors(worker_root):
        writer = getattr(getattr(node.connector, "connector_worker", None), "writer", None)
        if writer is not None and not writer.flush(timeout_s):
            logger.warning("%s: background writes still queued after %.0f s", node.path, timeout_s)


def connector_snapshot(llm: Any, store_paths: dict[str, str]) -> ConnectorSnapshot:
    """Cumulative counters of the engine's connectors, by node name."""
    from kvcompose.composite import CompositeConnector

    by_path = {os.path.realpath(p): n for n, p in store_paths.items()}

    def store_of(conn: Any) -> str | None:
        path = getattr(getattr(conn, "config", None), "path", None)
        return by_path.get(os.path.realpath(path)) if isinstance(path, str) else None

    def child_name(index: int, conn: Any) -> str:
        return store_of(conn) or f"{index}-{type(conn).__name__}"

    try:
        sched_root = probe.scheduler_connector(llm)
    except (AttributeError, RuntimeError):
        sched_root = None
    try:
        worker_root = probe.worker_connector()
    except Exception:
        worker_root = None
    any_root = sched_root if sched_root is not None else worker_root
    if any_root is None:
        return ConnectorSnapshot()
    if isinstance(any_root, CompositeConnector):
        root_name = any_root.name
    else:
        root_name = store_of(any_root) or type(any_root).__name__
    sched = {
        n.path: n
        for n in probe.walk_connectors(sched_root, root_name=root_name, child_name=child_name)
    }
    worker = {
        n.path: n
        for n in probe.walk_connectors(worker_root, root_name=root_name, child_name=child_name)
    }
    paths = [*sched, *(p for p in worker if p not in sched)]
    tree = {p: sched.get(p) or worker[p] for p in paths}
    out = ConnectorSnapshot()
    for path, node in tree.items():
        s, w = sched.get(path), worker.get(path)
        conn, cls = node.connector, type(node.connector)
        entry = SnapshotNode(
            cls=f"{cls.__module__}:{cls.__qualname__}",
            parent=tree[node.parent].name if node.parent else None,
            kind="leaf",
            children=[n.name for n in tree.values() if n.parent == path],
        )
        if isinstance(conn, CompositeConnector):
            entry.kind = "kvcompose"
            entry.policy = getattr(conn.spec, "policy", conn.spec.kind)
            entry.counters = _counters(s.connector) if s is not None else {}
        elif cls.__name__ == "MultiConnector" and isinstance(
            getattr(conn, "_connectors", None), list
        ):
            entry.kind = "multiconnector"
        else:
            store = store_of(conn) or node.name
            entry.store = store if store in store_paths else None
            total = getattr(w.connector, "total_stats", None) if w is not None else None
            if total is not None and entry.store is not None:
                out.stores[entry.store] = {
                    k: v for k, v in dict(total.data).items() if isinstance(v, int | float)
                }
        out.nodes[node.name] = entry
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in after.items():
        prev = before.get(key, 0)
        if isinstance(value, int | float) and isinstance(prev, int | float):
            d = value - prev
            out[key] = round(d, 6) if isinstance(d, float) else d
    return out


def snapshot_delta(after: ConnectorSnapshot, before: ConnectorSnapshot) -> ConnectorSnapshot:
    nodes = {}
    for name, entry in after.nodes.items():
        prev = before.nodes.get(name)
        nodes[name] = entry.model_copy(
            update={"counters": _delta(entry.counters, prev.counters if prev else {})}
        )
    stores = {
        name: _delta(stats, before.stores.get(name, {})) for name, stats in after.stores.items()
    }
    return ConnectorSnapshot(nodes=nodes, stores=stores)
