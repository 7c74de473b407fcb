"""From the runs of every contender to one ``ContenderResult`` each."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcompose.bench import metrics
from kvcompose.bench.contenders import ContenderDef, ResolvedContender
from kvcompose.bench.results import ContenderResult, RequestRecord, RequestRow, RunResult, Timings


@dataclass
class Contender:
    """A contender of this run: its definition, how it resolved, and its runs."""

    definition: ContenderDef
    resolved: ResolvedContender | None = None
    runs: list[RunResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.definition.label

    def ok_runs(self) -> list[RunResult]:
        return [r for r in self.runs if r.ok]

    def pooled(self) -> list[tuple[RunResult, RequestRecord]]:
        """Every request of every successful run, with its run."""
        return [(run, r) for run in self.ok_runs() for r in run.requests]

    def policy(self) -> str | None:
        tree = self.resolved.tree if self.resolved else None
        if tree is None:
            if self.resolved and self.resolved.connector == "MultiConnector":
                return "first (MultiConnector)"
            return None
        return getattr(tree, "policy", None) or getattr(tree, "kind", None)


def _keyed(pooled: list[tuple[RunResult, RequestRecord]], several: bool) -> list[RequestRecord]:
    """The records with ids unique over runs (``s<seed>/r<round>/<id>`` when each contender
    runs several times)."""
    if not several:
        return [rec for _, rec in pooled]
    return [
        rec.model_copy(update={"id": f"s{run.seed}/r{run.round}/{rec.id}"}) for run, rec in pooled
    ]


def summarise(contenders: list[Contender], *, several_runs: bool) -> list[ContenderResult]:
    reference = next((c for c in contenders if c.definition.kind == "none" and c.ok_runs()), None)
    ref_records = _keyed(reference.pooled(), several_runs) if reference else []
    out = []
    for c in contenders:
        d = c.definition
        entry = ContenderResult(
            label=c.label,
            source=d.source,
            kind=d.kind,
            description=d.description,
            connector=c.resolved.connector if c.resolved else None,
            policy=c.policy(),
            kv_transfer_config=c.resolved.kv_transfer_config if c.resolved else None,
        )
        failed = [r for r in c.runs if not r.ok]
        if not c.runs or len(failed) == len(c.runs):
            entry.status = "failed"
            first = failed[0] if failed else None
            entry.error = (first.error if first else None) or "did not run"
            entry.log = first.log if first else None
            out.append(entry)
            continue
        entry.status = "ok" if not failed else "partial"
        if failed:
            entry.error = "; ".join(f"seed {r.seed} round {r.round + 1}: {r.error}" for r in failed)
        pooled = c.pooled()
        records = [rec for _, rec in pooled]
        runs = c.ok_runs()
        entry.latency = metrics.latency_summary(records)
        entry.throughput = metrics.mean_throughput([metrics.throughput(r.requests) for r in runs])
        entry.hits = metrics.per_replay_hits(runs)
        entry.timings = Timings(
            **{k: metrics.mean(getattr(r, k) for r in runs) for k in Timings.model_fields}
        )
        if reference is not None:
            entry.agreement = metrics.agreement(
                _keyed(pooled, several_runs), ref_records, reference.label
            )
        entry.kv_cache = next((r.kv_cache for r in runs if r.kv_cache is not None), None)
        counted = [r.preemptions for r in runs if r.preemptions is not None]
        entry.preemptions = statistics.mean(counted) if counted else None
        peaks = [r.peak_running for r in runs if r.peak_running is not None]
        entry.peak_running = min(peaks) if peaks else None
        leftovers = [r.live_requests_after for r in runs]
        if any(leftovers):
            entry.live_requests_after = leftovers
        entry.requests = [_row(run, rec) for run, rec in pooled]
        out.append(entry)
    compare_rounds(out, reference.label if reference else None)
    return out


@dataclass(frozen=True)
class Paired:
    """One contender's TTFT p50 over another's, taken within each round (the two ran in the
    same round, minutes apart), with their median and range."""

    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)


def paired_ratios(
    num: Mapping[Any, float] | Sequence[float], den: Mapping[Any, float] | Sequence[float]
) -> Paired:
    """``num / den`` round by round: mappings (round -> TTFT p50) are paired by round,
    rounds missing on either side or zero skipped; lists (``ttft_p50_rounds`` of
    ``results.json``, both in round order) by position, and must be as long as each other."""
    if isinstance(num, Mapping) and isinstance(den, Mapping):
        a, b = num, den
    elif len(num) != len(den):
        raise ValueError(f"{len(num)} rounds against {len(den)}: cannot pair them")
    else:
        a, b = dict(enumerate(num)), dict(enumerate(den))
    return Paired([v / b[k] for k, v in a.items() if v and b.get(k)])


def compare_rounds(out: list[ContenderResult], reference: str | None) -> None:
    """From the requests of every round (seed and round): each contender's TTFT p50 per
    round; the reference's over the contender's within each round (``paired_ratios``), their
    median and range; and which contenders are within noise of each other: those whose TTFT
    p50s over the rounds span overlapping ranges (with fewer than two rounds, no claim is
    made)."""
    p50s = {e.label: _round_percentiles(e.requests, 50) for e in out}
    ref = p50s.get(reference or "", {})
    for e in out:
        mine = p50s[e.label]
        e.ttft_p50_rounds = [round(v, 4) for v in mine.values()]
        e.ttft_p90_rounds = [round(v, 4) for v in _round_percentiles(e.requests, 90).values()]
        ratios = [round(x, 3) for x in paired_ratios(ref, mine).ratios]
        if ratios:
            e.speedup_rounds = ratios
            e.ttft_p50_speedup = round(statistics.median(ratios), 3)  # stays in [min, max]
            e.speedup_low, e.speedup_high = min(ratios), max(ratios)
    spans = {
        e.label: (min(e.ttft_p50_rounds), max(e.ttft_p50_rounds))
        for e in out
        if len(e.ttft_p50_rounds) >= 2
    }
    for e in out:
        if e.label in spans:
            lo, hi = spans[e.label]
            e.within_noise_of = [
                label
                for label, (olo, ohi) in spans.items()
                if label != e.label and olo <= hi and lo <= ohi
            ]


def _round_percentiles(rows: list[RequestRow], q: float) -> dict[tuple[int, int], float]:
    """TTFT percentile ``q`` per (seed, round), in run order."""
    by_round: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        if r.ttft_s is not None:
            by_round.setdefault((r.seed, r.round), []).append(r.ttft_s)
    return {
        k: p for k, v in sorted(by_round.items()) if (p := metrics.percentile(v, q)) is not None
    }


def _row(run: RunResult, rec: RequestRecord) -> RequestRow:
    ttft, tpot, e2e = metrics.request_latencies(rec)
    return RequestRow(
        id=rec.id,
        seed=run.seed,
        round=run.round,
        prompt_tokens=rec.prompt_tokens,
        cached_tokens=rec.num_cached_tokens,
        output_tokens=len(rec.output_token_ids),
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        arrival_s=rec.arrival_s,
    )
