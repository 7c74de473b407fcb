"""The PNG plots of ``kvcompose bench`` (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

import inspect
import random
from pathlib import Path
from typing import Any

from kvcompose.bench.results import BenchResults, ContenderResult


def write_plots(results: BenchResults, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in results.contenders if c.requests]
    files = {}
    for name, plot in (("ttft", _ttft_plot), ("hit_tokens", _hits_plot)):
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        plot(ax, shown)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        files[f"{name}_png"] = str(out / f"{name}.png")

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    _ttft_plot(axes[0], shown)
    _hits_plot(axes[1], shown)
    meta = results.meta
    fig.suptitle(
        f"kvcompose bench: {meta.workload.get('name')} workload, "
        f"{meta.workload.get('requests')} requests, "
        f"model {Path(str(meta.model.get('path', ''))).name}, "
        f"{meta.machine.get('cpus')} CPUs",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=100)
    plt.close(fig)
    files["summary_png"] = str(out / "summary.png")
    return files


def _ttft_plot(ax: Any, shown: list[ContenderResult]) -> None:
    data = [[r.ttft_s for r in c.requests if r.ttft_s is not None] for c in shown]
    labels = [c.label for c in shown]
    if not any(data):
        ax.text(0.5, 0.5, "no finished requests", ha="center", transform=ax.transAxes)
        return
    positions = list(range(1, len(shown) + 1))
    horizontal = (
        {"orientation": "horizontal"}
        if "orientation" in inspect.signature(ax.boxplot).parameters
        else {"vert": False}
    )  # matplotlib < 3.10
    ax.boxplot(
        [d or [0.0] for d in data],
        positions=positions,
        widths=0.55,
        showfliers=False,
        medianprops={"color": "black"},
        **horizontal,
    )
    rng = random.Random(0)
    for pos, d in zip(positions, data, strict=True):
        ax.scatter(
            d,
            [pos + rng.uniform(-0.18, 0.18) for _ in d],
            s=10,
            alpha=0.55,
            color="tab:blue",
            zorder=3,
        )
    ax.set_yticks(positions)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_title("TTFT per request (box: p25-p75, line: p50)")
    for pos, c in zip(positions, shown, strict=True):
        p50 = c.latency.ttft_p50_s if c.latency else None
        if p50:
            ax.annotate(f"p50 {p50 * 1000:.0f} ms", (p50, pos - 0.32), fontsize=8, ha="center")
    ax.grid(axis="x", alpha=0.3, which="both")


def _hits_plot(ax: Any, shown: list[ContenderResult]) -> None:
    stores: list[str] = []
    for c in shown:
        for s in c.hits.stores if c.hits else {}:
            if s not in stores:
                stores.append(s)
    labels = [c.label for c in shown]
    xs = list(range(len(shown)))
    bottom = [0.0] * len(shown)
    colors = ["tab:orange", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:gray"]
    for i, store in enumerate(stores):
        vals = [
            float(c.hits.stores[store].tokens_loaded) if c.hits and store in c.hits.stores else 0.0
            for c in shown
        ]
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
