"""Latency and throughput metrics, per-node hit summaries and output agreement."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

from kvcompose.bench.results import (
    Agreement,
    ChildHits,
    HitSummary,
    LatencySummary,
    NodeHits,
    RequestRecord,
    RunResult,
    StoreHits,
    Throughput,
)


def percentile(values: Iterable[float | None], q: int) -> float | None:
    """The ``q``-th percentile (an integer 0..100), interpolated linearly between the closest
    ranks (``statistics``' inclusive method, numpy's default); None for no values."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if len(xs) < 2 or q <= 0 or q >= 100:
        return (min(xs) if q <= 50 else max(xs)) if xs else None
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def mean(values: Iterable[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def request_latencies(rec: RequestRecord) -> tuple[float | None, float | None, float | None]:
    """TTFT, TPOT and end-to-end latency of one replayed request."""
    first, finish = rec.first_token_s, rec.finish_s
    n_out = len(rec.output_token_ids)
    ttft = None if first is None else max(first - rec.arrival_s, 0.0)
    e2e = None if finish is None else max(finish - rec.arrival_s, 0.0)
    tpot = None
    if first is not None and finish is not None and n_out > 1:
        tpot = (finish - first) / (n_out - 1)
    return ttft, tpot, e2e


def latency_summary(records: Sequence[RequestRecord]) -> LatencySummary:
    """TTFT/TPOT/E2E percentiles over replayed requests (pooled)."""
    lat = [request_latencies(r) for r in records]
    out: dict[str, float | None] = {}
    for i, name in enumerate(("ttft", "tpot", "e2e")):
        xs = [x[i] for x in lat if x[i] is not None]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = _r(percentile(xs, q))
        out[f"{name}_mean_s"] = _r(mean(xs))
    return LatencySummary(
        requests=len(records), finished=sum(1 for r in records if r.finish_s is not None), **out
    )


def throughput(records: Sequence[RequestRecord]) -> Throughput:
    """Requests/s and tokens/s over one replay: from the first arrival to the last finish."""
    done = [r for r in records if r.finish_s is not None]
    if not done:
        return Throughput()
    start = min(r.arrival_s for r in records)
    end = max(r.finish_s for r in done if r.finish_s is not None)
    dur = max(end - start, 1e-9)
    out_tokens = sum(len(r.output_token_ids) for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    return Throughput(
        duration_s=_r(dur),
        requests_per_s=_r(len(done) / dur),
        output_tokens_per_s=_r(out_tokens / dur),
        total_tokens_per_s=_r((out_tokens + prompt_tokens) / dur),
    )


def mean_throughput(runs: Sequence[Throughput]) -> Throughput:
    return Throughput(**{k: mean(getattr(t, k) for t in runs) for k in Throughput.model_fields})


def agreement(
    records: Sequence[RequestRecord],
    reference: Sequence[RequestRecord],
    reference_label: str | None = None,
) -> Agreement:
    """Share of requests whose greedy output token ids equal the reference run's."""
    ref = {r.id: r.output_token_ids for r in reference}
    compared = same = 0
    mismatched: list[str] = []
    for r in records:
        if r.id not in ref:
            continue
        compared += 1
        if list(r.output_token_ids) == list(ref[r.id]):
            same += 1
        else:
            mismatched.append(r.id)
    return Agreement(
        compared=compared,
        identical=same,
        percent=_r(100.0 * same / compared, 2) if compared else None,
        mismatched=mismatched[:20],
        reference=reference_label,
    )


def hit_summary(result: RunResult) -> HitSummary:
    """Per-store and per-node reuse of one run (counter deltas over the replay)."""
    conn = result.connector
    stores: dict[str, StoreHits] = {}
    for name, stats in conn.stores.items():
        usage = result.store_usage.get(name)
        growth = (usage.after.get("bytes", 0) - usage.before.get("bytes", 0)) if usage else 0
        stores[name] = StoreHits(
            tokens_loaded=int(stats.get("tokens_loaded", 0)),
            chunks_loaded=int(stats.get("chunks_loaded", 0)),
            bytes_loaded=int(stats.get("bytes_loaded", 0)),
            tokens_saved=int(stats.get("tokens_saved", 0)),
            bytes_written=int(stats.get("bytes_saved", 0)),
            store_growth_bytes=int(growth),
            load_time_s=_r(stats.get("load_time_s", 0.0)),
            save_time_s=_r(stats.get("save_time_s", 0.0)),
            load_failures=int(stats.get("load_failures", 0)),
        )
    nodes: dict[str, NodeHits] = {}
    for name, entry in conn.nodes.items():
        if entry.kind != "kvcompose":
            continue
        c = entry.counters
        nodes[name] = NodeHits(
            policy=entry.policy,
            lookups=int(c.get("lookups", 0)),
            children={
                child: ChildHits(
                    hits=int(c.get(f"hits.{child}", 0)),
                    hit_tokens=int(c.get(f"hit_tokens.{child}", 0)),
                )
                for child in entry.children
            },
            other_counters={
                k: v for k, v in c.items() if k != "lookups" and not k.startswith("hit")
            },
        )
    reqs = result.requests
    return HitSummary(
        stores=stores,
        nodes=nodes,
        cached_tokens=sum(r.num_cached_tokens for r in reqs),
        requests_with_cached_tokens=sum(1 for r in reqs if r.num_cached_tokens),
        tokens_loaded=sum(s.tokens_loaded for s in stores.values()),
        bytes_written=sum(s.bytes_written for s in stores.values()),
    )


def merge_hits(hits: Sequence[HitSummary]) -> HitSummary:
    """Sum hit summaries over runs."""
    if len(hits) == 1:
        return hits[0]
    merged = HitSummary()
    for h in hits:
        for k in ("cached_tokens", "tokens_loaded", "bytes_written", "requests_with_cached_tokens"):
            setattr(merged, k, getattr(merged, k) + getattr(h, k))
        for name, s in h.stores.items():
            dst = merged.stores.setdefault(name, StoreHits())
            for k in StoreHits.model_fields:
                setattr(dst, k, (getattr(dst, k) or 0) + (getattr(s, k) or 0))
        for name, n in h.nodes.items():
            node = merged.nodes.setdefault(name, NodeHits(policy=n.policy))
            node.lookups += n.lookups
            for c, v in n.children.items():
                d = node.children.setdefault(c, ChildHits())
                d.hits += v.hits
                d.hit_tokens += v.hit_tokens
            for k, v in n.other_counters.items():
                node.other_counters[k] = node.other_counters.get(k, 0) + v
    return merged


def per_replay_hits(runs: Sequence[RunResult]) -> HitSummary:
    """Hits of one replay of each seed's workload: the mean over a seed's rounds (each round
    replays the same workload), summed over seeds."""
    by_seed: dict[int, list[HitSummary]] = {}
    for run in runs:
        by_seed.setdefault(run.seed, []).append(hit_summary(run))
    return merge_hits([_divided(merge_hits(hits), len(hits)) for hits in by_seed.values()])


def _divided(h: HitSummary, n: int) -> HitSummary:
    """Every count of ``h`` divided by ``n`` (integers rounded)."""
    if n == 1:
        return h

    def div(model: Any) -> Any:
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, bool):
                continue
            if isinstance(value, int):
                setattr(model, name, round(value / n))
            elif isinstance(value, float):
                setattr(model, name, value / n)
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        value[k] = v / n if isinstance(v, float) else round(v / n)
                    elif isinstance(v, BaseModel):
                        div(v)
        return model

    return div(h.model_copy(deep=True))


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)
