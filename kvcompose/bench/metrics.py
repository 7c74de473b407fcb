"""Latency and throughput metrics, per-node hit summaries and output agreement."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


def request_latencies(rec: dict[str, Any]) -> dict[str, float | None]:
    """TTFT, TPOT and end-to-end latency (seconds) of one replayed request."""
    arrival = rec["arrival_s"]
    first, finish = rec.get("first_token_s"), rec.get("finish_s")
    n_out = len(rec.get("output_token_ids", []))
    ttft = None if first is None else max(first - arrival, 0.0)
    e2e = None if finish is None else max(finish - arrival, 0.0)
    tpot = None
    if first is not None and finish is not None and n_out > 1:
        tpot = (finish - first) / (n_out - 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}


def latency_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """TTFT/TPOT/E2E percentiles and throughput over replayed requests (pooled)."""
    lat = [request_latencies(r) for r in records]
    ttft = [x["ttft_s"] for x in lat if x["ttft_s"] is not None]
    tpot = [x["tpot_s"] for x in lat if x["tpot_s"] is not None]
    e2e = [x["e2e_s"] for x in lat if x["e2e_s"] is not None]
    out: dict[str, Any] = {"requests": len(records),
                           "finished": sum(1 for r in records if r.get("finish_s") is not None)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = _r(percentile(xs, q))
        out[f"{name}_mean_s"] = _r(mean(xs))
    return out


def throughput(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Requests/s and tokens/s over one replay: from the first arrival to the last finish."""
    done = [r for r in records if r.get("finish_s") is not None]
    if not done:
        return {"duration_s": None, "requests_per_s": None, "output_tokens_per_s": None,
                "total_tokens_per_s": None}
    start = min(r["arrival_s"] for r in records)
    end = max(r["finish_s"] for r in done)
    dur = max(end - start, 1e-9)
    out_tokens = sum(len(r["output_token_ids"]) for r in done)
    prompt_tokens = sum(r["prompt_tokens"] for r in done)
    return {"duration_s": _r(dur), "requests_per_s": _r(len(done) / dur),
            "output_tokens_per_s": _r(out_tokens / dur),
            "total_tokens_per_s": _r((out_tokens + prompt_tokens) / dur)}


def agreement(records: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]
              ) -> dict[str, Any]:
    """Share of requests whose greedy output token ids equal the reference run's."""
    ref = {r["id"]: r["output_token_ids"] for r in reference}
    compared = same = 0
    mismatched: list[str] = []
    for r in records:
        if r["id"] not in ref:
            continue
        compared += 1
        if list(r["output_token_ids"]) == list(ref[r["id"]]):
            same += 1
        else:
            mismatched.append(r["id"])
    return {"compared": compared, "identical": same,
            "percent": _r(100.0 * same / compared, 2) if compared else None,
            "mismatched": mismatched[:20]}


def hit_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per-store and per-node reuse of one chain run (counter deltas over the replay)."""
    conn = result.get("connector") or {"nodes": {}, "stores": {}}
    stores: dict[str, Any] = {}
    for name, stats in conn.get("stores", {}).items():
        usage = (result.get("store_usage") or {}).get(name, {})
        before = usage.get("before", {}).get("bytes", 0)
        after = usage.get("after", {}).get("bytes", 0)
        stores[name] = {
            "tokens_loaded": int(stats.get("tokens_loaded", 0)),
            "chunks_loaded": int(stats.get("chunks_loaded", 0)),
            "bytes_loaded": int(stats.get("bytes_loaded", 0)),
            "tokens_saved": int(stats.get("tokens_saved", 0)),
            "bytes_written": int(stats.get("bytes_saved", 0)),
            "store_growth_bytes": int(after - before),
            "load_time_s": _r(stats.get("load_time_s", 0.0)),
            "save_time_s": _r(stats.get("save_time_s", 0.0)),
            "load_failures": int(stats.get("load_failures", 0)),
        }
    nodes: dict[str, Any] = {}
    for name, entry in conn.get("nodes", {}).items():
        if entry.get("kind") != "kvcompose":
            continue
        c = entry.get("counters", {})
        children = {}
        for child in entry.get("children", []):
            children[child] = {"hits": int(c.get(f"hits.{child}", 0)),
                               "hit_tokens": int(c.get(f"hit_tokens.{child}", 0))}
        nodes[name] = {"policy": entry.get("policy"), "lookups": int(c.get("lookups", 0)),
                       "children": children,
                       "other_counters": {k: v for k, v in c.items()
                                          if k != "lookups" and not k.startswith("hit")}}
    reqs = result.get("requests", [])
    cached = sum(int(r.get("num_cached_tokens", 0)) for r in reqs)
    return {"stores": stores, "nodes": nodes, "cached_tokens": cached,
            "requests_with_cached_tokens": sum(1 for r in reqs if r.get("num_cached_tokens")),
            "tokens_loaded": sum(s["tokens_loaded"] for s in stores.values()),
            "bytes_written": sum(s["bytes_written"] for s in stores.values())}


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)
