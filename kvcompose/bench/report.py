"""Outputs of ``kvcompose bench``: results JSON/CSV, per-request CSV, plots, terminal tables."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from kvcompose.bench.results import BenchResults, ContenderResult

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
REQUESTS_CSV = "requests.csv"
PLOTS = ("ttft.png", "hit_tokens.png", "summary.png")


def contender_rows(results: BenchResults) -> list[dict[str, Any]]:
    """One flat row per contender (``results.csv``)."""
    rows = []
    for c in results.contenders:
        lat = c.latency.model_dump() if c.latency else {}
        thr = c.throughput.model_dump() if c.throughput else {}
        hits = c.hits
        row: dict[str, Any] = {
            "contender": c.label,
            "status": c.status,
            "connector": c.connector,
            "policy": c.policy,
            "requests": lat.get("requests"),
            "finished": lat.get("finished"),
        }
        for m in ("ttft", "tpot", "e2e"):
            for q in ("p50", "p90", "p99", "mean"):
                row[f"{m}_{q}_s"] = lat.get(f"{m}_{q}_s")
        row.update(
            {
                "requests_per_s": thr.get("requests_per_s"),
                "output_tokens_per_s": thr.get("output_tokens_per_s"),
                "total_tokens_per_s": thr.get("total_tokens_per_s"),
                "ttft_p50_speedup": c.ttft_p50_speedup,
                "ttft_p50_rounds_s": " ".join(str(x) for x in c.ttft_p50_rounds),
                "speedup_low": c.speedup_low,
                "speedup_high": c.speedup_high,
                "within_noise_of": None
                if c.within_noise_of is None
                else " ".join(c.within_noise_of),
                "tokens_loaded": hits.tokens_loaded if hits else None,
                "cached_tokens": hits.cached_tokens if hits else None,
                "bytes_written": hits.bytes_written if hits else None,
                "agreement_percent": c.agreement.percent if c.agreement else None,
                "kv_blocks": c.kv_cache.num_blocks if c.kv_cache else None,
                "kv_groups": len(c.kv_cache.groups) if c.kv_cache else None,
                "hma": c.kv_cache.hma if c.kv_cache else None,
                "preemptions": c.preemptions,
                "peak_running": c.peak_running,
                "error": c.error,
            }
        )
        for store, s in sorted((hits.stores if hits else {}).items()):
            row[f"{store}.tokens_loaded"] = s.tokens_loaded
            row[f"{store}.bytes_written"] = s.bytes_written
        for node, n in sorted((hits.nodes if hits else {}).items()):
            row[f"{node}.lookups"] = n.lookups
            for child, v in n.children.items():
                row[f"{node}.hits.{child}"] = v.hits
                row[f"{node}.hit_tokens.{child}"] = v.hit_tokens
        rows.append(row)
    return rows


def request_rows(results: BenchResults) -> list[dict[str, Any]]:
    return [
        {"contender": c.label, **r.model_dump()} for c in results.contenders for r in c.requests
    ]


def read_results(out: Path) -> BenchResults:
    """``results.json`` with the per-request rows of ``requests.csv`` put back."""
    from kvcompose.bench.results import RequestRow

    results = BenchResults.model_validate_json((out / RESULTS_JSON).read_text())
    by_label = {c.label: c for c in results.contenders}
    with open(out / REQUESTS_CSV, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            values = {k: (None if v == "" else v) for k, v in row.items()}
            by_label[values.pop("contender") or ""].requests.append(
                RequestRow.model_validate(values)
            )
    return results


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as CSV; the columns are every key, in the order they first appear."""
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        if fields:
            writer.writeheader()
        writer.writerows(rows)


def write_all(results: BenchResults, out: Path, *, plots: bool = True) -> None:
    write_csv(out / RESULTS_CSV, contender_rows(results))
    write_csv(out / REQUESTS_CSV, request_rows(results))
    results.files = {
        "results_json": str(out / RESULTS_JSON),
        "results_csv": str(out / RESULTS_CSV),
        "requests_csv": str(out / REQUESTS_CSV),
    }
    if plots:
        try:
            from kvcompose.bench.plots import write_plots

            results.files.update(write_plots(results, out))
        except ImportError as exc:  # matplotlib missing: everything else is written
            results.plot_error = f"plots skipped: {exc} (pip install 'kvcompose[bench]')"
    (out / RESULTS_JSON).write_text(results.model_dump_json(indent=1) + "\n")


# --------------------------------------------------------------------------- terminal


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def _num(x: float | None, fmt: str = "{:,.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _speedup(c: ContenderResult) -> str:
    """``6.3x (5.9-6.6)``: the median of the within-round ratios, and their range."""
    if c.ttft_p50_speedup is None:
        return "-"
    if len(c.speedup_rounds) < 2:
        return f"{c.ttft_p50_speedup:.1f}x"
    return f"{c.ttft_p50_speedup:.1f}x ({c.speedup_low:.1f}-{c.speedup_high:.1f})"


def _blocks(c: ContenderResult) -> str:
    """The KV cache blocks vLLM allocated, with the groups when there are several."""
    kv = c.kv_cache
    if kv is None:
        return "-"
    return f"{kv.num_blocks:,}" + (f" ({len(kv.groups)} groups)" if len(kv.groups) > 1 else "")


def _hma(c: ContenderResult) -> str:
    """Whether vLLM kept its hybrid KV cache manager on (measured in the engine)."""
    return "-" if c.kv_cache is None else ("on" if c.kv_cache.hma else "off")


def tables(results: BenchResults) -> list[Any]:
    """Rich tables: the comparison, and per-node counters (labels and store names escaped:
    a user's ``[/x]`` is text, not markup)."""
    from rich.markup import escape
    from rich.table import Table

    meta, wl = results.meta, results.meta.workload
    rounds = meta.repeats * max(len(meta.seeds), 1)
    noise = any(c.within_noise_of is not None for c in results.contenders)
    main = Table(
        title=f"kvcompose bench — {wl.get('name')} workload, {wl.get('requests')} requests, "
        f"{meta.repeats} round{'s' if meta.repeats != 1 else ''} (times in ms over all "
        "rounds; vs recompute: TTFT p50 ratio within each round, median (range))",
        title_justify="left",
        caption=(
            f"within noise of: contenders whose TTFT p50s over the {rounds} rounds span a "
            "range that overlaps this one's; this run cannot tell them apart"
            if noise
            else None
        ),
        caption_justify="left",
    )
    main.add_column("contender", no_wrap=True)
    if noise:
        main.add_column("TTFT p50 by round", justify="right", no_wrap=True)
    for col in (
        "TTFT p50",
        "p90",
        "p99",
        "TPOT p50",
        "E2E p50",
        "req/s",
        "tok/s",
        "hit tok",
        "MB saved",
        "agree %",
        "KV blocks",
        "HMA",
        "vs recompute",
    ):
        main.add_column(col, justify="right")
    if noise:
        main.add_column("within noise of", justify="left")
    stores_table = Table(
        title="per node (one replay: mean over rounds; counters from the stores and from "
        "kvcompose's per-node stats)",
        title_justify="left",
    )
    for col in (
        "contender",
        "node",
        "lookups",
        "hits",
        "hit tokens",
        "tokens loaded",
        "MB written",
    ):
        stores_table.add_column(
            col,
            justify="left" if col in ("contender", "node") else "right",
            no_wrap=col == "contender",
        )
    for c in results.contenders:
        if not c.ran or c.latency is None or c.hits is None:
            main.add_row(f"{escape(c.label)} [red](failed)[/red]", *["-"] * (13 + 2 * noise))
            continue
        lat, thr, hits = c.latency, c.throughput, c.hits
        agree = c.agreement.percent if c.agreement else None
        agree_txt = (
            "-"
            if agree is None
            else (f"{agree:.0f}" if agree == 100 else f"[red]{agree:.1f}[/red]")
        )
        label = escape(c.label if c.status == "ok" else f"{c.label} ({c.status})")
        main.add_row(
            label,
            *([" ".join(_ms(x) for x in c.ttft_p50_rounds)] if noise else []),
            _ms(lat.ttft_p50_s),
            _ms(lat.ttft_p90_s),
            _ms(lat.ttft_p99_s),
            _ms(lat.tpot_p50_s),
            _ms(lat.e2e_p50_s),
            _num(thr.requests_per_s if thr else None),
            _num(thr.total_tokens_per_s if thr else None, "{:,.0f}"),
            f"{hits.tokens_loaded:,}",
            _num(hits.bytes_written / 1e6, "{:,.1f}"),
            agree_txt,
            _blocks(c),
            _hma(c),
            _speedup(c),
            *([", ".join(c.within_noise_of or []) or "none"] if noise else []),
        )
        node_hits: dict[str, tuple[int, int, int]] = {}
        for n in hits.nodes.values():
            for child, v in n.children.items():
                node_hits[child] = (v.hits, v.hit_tokens, n.lookups)
        for store, s in hits.stores.items():
            h = node_hits.get(store)
            stores_table.add_row(
                escape(c.label),
                escape(store),
                "-" if h is None else str(h[2]),
                "-" if h is None else str(h[0]),
                "-" if h is None else f"{h[1]:,}",
                f"{s.tokens_loaded:,}",
                _num(s.bytes_written / 1e6, "{:,.1f}"),
            )
    return [main, stores_table]
