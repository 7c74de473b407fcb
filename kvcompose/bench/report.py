"""Outputs of ``kvcompose bench``: results JSON/CSV, per-request CSV, plots, terminal tables."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
REQUESTS_CSV = "requests.csv"
PLOTS = ("ttft.png", "hit_tokens.png", "summary.png")


def slim(results: dict[str, Any]) -> dict[str, Any]:
    """The results without per-request rows (those go to ``requests.csv``)."""
    out = copy.deepcopy(results)
    for chain in out.get("chains", []):
        chain.pop("requests", None)
    return out


def chain_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat row per chain (``results.csv``)."""
    rows = []
    for c in results.get("chains", []):
        lat = c.get("latency") or {}
        thr = c.get("throughput") or {}
        hits = c.get("hits") or {}
        row: dict[str, Any] = {
            "chain": c["label"], "status": c.get("status"), "connector": c.get("connector"),
            "policy": c.get("policy"),
            "requests": lat.get("requests"), "finished": lat.get("finished"),
        }
        for m in ("ttft", "tpot", "e2e"):
            for q in ("p50", "p90", "p99", "mean"):
                row[f"{m}_{q}_s"] = lat.get(f"{m}_{q}_s")
        row.update({
            "requests_per_s": thr.get("requests_per_s"),
            "output_tokens_per_s": thr.get("output_tokens_per_s"),
            "total_tokens_per_s": thr.get("total_tokens_per_s"),
            "ttft_p50_speedup": c.get("ttft_p50_speedup"),
            "tokens_loaded": hits.get("tokens_loaded"),
            "cached_tokens": hits.get("cached_tokens"),
            "bytes_written": hits.get("bytes_written"),
            "agreement_percent": (c.get("agreement") or {}).get("percent"),
            "error": c.get("error"),
        })
        for store, s in sorted((hits.get("stores") or {}).items()):
            row[f"{store}.tokens_loaded"] = s.get("tokens_loaded")
            row[f"{store}.bytes_written"] = s.get("bytes_written")
        for node, n in sorted((hits.get("nodes") or {}).items()):
            row[f"{node}.lookups"] = n.get("lookups")
            for child, v in n.get("children", {}).items():
                row[f"{node}.hits.{child}"] = v["hits"]
                row[f"{node}.hit_tokens.{child}"] = v["hit_tokens"]
        rows.append(row)
    return rows


def request_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in results.get("chains", []):
        for r in c.get("requests", []):
            rows.append({"chain": c["label"], **r})
    return rows


def write_all(results: dict[str, Any], runs: Any, out: Path, *, plots: bool = True) -> None:
    from kvcompose.bench.core import write_csv

    (out / RESULTS_JSON).write_text(json.dumps(slim(results), indent=1, default=str) + "\n")
    write_csv(out / RESULTS_CSV, chain_rows(results))
    write_csv(out / REQUESTS_CSV, request_rows(results))
    results.setdefault("files", {})
    results["files"] = {"results_json": str(out / RESULTS_JSON),
                        "results_csv": str(out / RESULTS_CSV),
                        "requests_csv": str(out / REQUESTS_CSV)}
    if plots:
        try:
            results["files"].update(write_plots(results, out))
        except ImportError as exc:  # matplotlib missing: everything else is written
            results["plot_error"] = f"plots skipped: {exc} (pip install 'kvcompose[bench]')"
    (out / RESULTS_JSON).write_text(json.dumps(slim(results), indent=1, default=str) + "\n")


# --------------------------------------------------------------------------- plots


def write_plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chains = [c for c in results.get("chains", []) if c.get("requests")]
    files = {}
    for name, plot in (("ttft", _ttft_plot), ("hit_tokens", _hits_plot)):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        plot(ax, chains)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        files[f"{name}_png"] = str(out / f"{name}.png")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    _ttft_plot(axes[0], chains)
    _hits_plot(axes[1], chains)
    meta = results.get("meta", {})
    wl = meta.get("workload", {})
    fig.suptitle(f"kvcompose bench: {wl.get('name')} workload, {wl.get('requests')} requests, "
                 f"model {Path(str(meta.get('model', {}).get('path', ''))).name}, "
                 f"{(meta.get('machine') or {}).get('cpus')} CPUs", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=100)
    plt.close(fig)
    files["summary_png"] = str(out / "summary.png")
    return files


def _ttft_plot(ax: Any, chains: list[dict[str, Any]]) -> None:
    import random

    data = [[r["ttft_s"] for r in c["requests"] if r.get("ttft_s") is not None] for c in chains]
    labels = [c["label"] for c in chains]
    if not any(data):
        ax.text(0.5, 0.5, "no finished requests", ha="center", transform=ax.transAxes)
        return
    positions = list(range(1, len(chains) + 1))
    import inspect

    horizontal = ({"orientation": "horizontal"}
                  if "orientation" in inspect.signature(ax.boxplot).parameters
                  else {"vert": False})  # matplotlib < 3.10
    ax.boxplot([d or [0.0] for d in data], positions=positions, widths=0.55,
               showfliers=False, medianprops={"color": "black"}, **horizontal)
    rng = random.Random(0)
    for pos, d in zip(positions, data, strict=True):
        ax.scatter(d, [pos + rng.uniform(-0.18, 0.18) for _ in d], s=10, alpha=0.55,
                   color="tab:blue", zorder=3)
    ax.set_yticks(positions)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_title("TTFT per request (box: p25-p75, line: p50)")
    for pos, c in zip(positions, chains, strict=True):
        p50 = (c.get("latency") or {}).get("ttft_p50_s")
        if p50:
            ax.annotate(f"p50 {p50 * 1000:.0f} ms", (p50, pos - 0.32), fontsize=8,
                        ha="center")
    ax.grid(axis="x", alpha=0.3, which="both")


def _hits_plot(ax: Any, chains: list[dict[str, Any]]) -> None:
    stores: list[str] = []
    for c in chains:
        for s in ((c.get("hits") or {}).get("stores") or {}):
            if s not in stores:
                stores.append(s)
    labels = [c["label"] for c in chains]
    xs = list(range(len(chains)))
    bottom = [0.0] * len(chains)
    colors = ["tab:orange", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:gray"]
    for i, store in enumerate(stores):
        vals = [float(((c.get("hits") or {}).get("stores") or {}).get(store, {})
                      .get("tokens_loaded", 0)) for c in chains]
        ax.bar(xs, vals, bottom=bottom, label=f"{store} store", color=colors[i % len(colors)])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax.annotate(f"{int(total):,}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max([*bottom, 1.0]) * 1.12)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("prompt tokens loaded (sum over requests)")
    ax.set_title("hit tokens per node (tokens each store loaded)")
    if stores:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


# --------------------------------------------------------------------------- terminal


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def _num(x: float | None, fmt: str = "{:,.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(results: dict[str, Any]) -> list[Any]:
    """Rich tables: the comparison, and per-node counters."""
    from rich.table import Table

    wl = results.get("meta", {}).get("workload", {})
    main = Table(title=f"kvcompose bench — {wl.get('name')} workload, "
                       f"{wl.get('requests')} requests (times in ms; speedup: TTFT p50 vs "
                       "recompute)", title_justify="left")
    main.add_column("chain", no_wrap=True)
    for col in ("TTFT p50", "p90", "p99", "TPOT p50", "E2E p50", "req/s", "tok/s",
                "hit tok", "MB saved", "agree %", "speedup"):
        main.add_column(col, justify="right", min_width=7 if col == "speedup" else None)
    stores_table = Table(title="per node (replay only; counters from the stores and from "
                               "kvcompose's per-node stats)", title_justify="left")
    for col in ("chain", "node", "lookups", "hits", "hit tokens", "tokens loaded",
                "MB written"):
        stores_table.add_column(col, justify="left" if col in ("chain", "node") else "right",
                                no_wrap=col == "chain")
    for c in results.get("chains", []):
        if c.get("status") == "failed":
            main.add_row(f"{c['label']} [red](failed)[/red]", *["-"] * 11)
            continue
        lat, thr, hits = c.get("latency", {}), c.get("throughput", {}), c.get("hits", {})
        agree = (c.get("agreement") or {}).get("percent")
        agree_txt = "-" if agree is None else (f"{agree:.0f}" if agree == 100 else
                                               f"[red]{agree:.1f}[/red]")
        speed = c.get("ttft_p50_speedup")
        label = c["label"] if c.get("status") == "ok" else f"{c['label']} ({c.get('status')})"
        main.add_row(
            label, _ms(lat.get("ttft_p50_s")),
            _ms(lat.get("ttft_p90_s")), _ms(lat.get("ttft_p99_s")), _ms(lat.get("tpot_p50_s")),
            _ms(lat.get("e2e_p50_s")), _num(thr.get("requests_per_s")),
            _num(thr.get("total_tokens_per_s"), "{:,.0f}"),
            f"{hits.get('tokens_loaded', 0):,}", _num(hits.get("bytes_written", 0) / 1e6,
                                                      "{:,.1f}"),
            agree_txt, "-" if speed is None else f"{speed:.1f}x")
        node_hits: dict[str, tuple[int, int, int | None]] = {}
        for n in (hits.get("nodes") or {}).values():
            for child, v in n.get("children", {}).items():
                node_hits[child] = (v["hits"], v["hit_tokens"], n.get("lookups"))
        for store, s in (hits.get("stores") or {}).items():
            h = node_hits.get(store)
            stores_table.add_row(c["label"], store, "-" if h is None else str(h[2]),
                                 "-" if h is None else str(h[0]),
                                 "-" if h is None else f"{h[1]:,}",
                                 f"{s.get('tokens_loaded', 0):,}",
                                 _num(s.get("bytes_written", 0) / 1e6, "{:,.1f}"))
    return [main, stores_table]


def goals_lines(results: dict[str, Any]) -> list[str]:
    g = results.get("goals", {})
    lines = []
    s = g.get("tier_ttft_p50_speedup")
    if s:
        lines.append(f"TTFT p50 vs recompute: best {s['best']:.1f}x ({s['best_chain']}); "
                     f"goal >= 5x: {'met' if s['met'] else 'NOT met'}")
    lm = g.get("longest_vs_multiconnector_hit_tokens")
    if lm:
        lines.append(f"hit tokens: {lm['longest']} {lm['longest_tokens']:,} vs "
                     f"{lm['multiconnector']} {lm['multiconnector_tokens']:,}; goal >=: "
                     f"{'met' if lm['met'] else 'NOT met'}"
                     f"{' (strictly more)' if lm['strictly_more'] else ''}")
    a = g.get("output_agreement_percent")
    if a:
        worst = min(a["by_chain"].values()) if a["by_chain"] else None
        lines.append(f"greedy output agreement with recompute: lowest {worst}%; goal 100%: "
                     f"{'met' if a['met'] else 'NOT met'}")
    if g.get("failed_chains"):
        lines.append(f"failed chains: {', '.join(g['failed_chains'])}")
    return lines
