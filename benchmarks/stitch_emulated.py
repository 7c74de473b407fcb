"""Stitch against longest when the slow tier really is slow.

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/stitch_emulated.py

On this machine both tiers are page cache, so the default comparison cannot show what stitch
saves: reading the fast tier's part from the fast tier. Here the disk tier's reads are
**emulated** as a network tier (``emulate_read: {latency_ms: 5, gbps: 0.25}``: every load
sleeps until 5 ms + bytes / 0.25 GB/s have passed; ``contenders/*-slowdisk.yaml``). Two
workloads where the fast tier holds prefixes of the slow tier's entries:

- ``chat`` (the default workload): fast = the shared system prompts (512 tokens), slow =
  returning users' whole histories;
- ``docqa`` with 4 questions per document: fast = each document's first 512 tokens, slow =
  the whole 1,536-token documents.

Each runs ``recompute``, ``longest`` and ``stitch`` (same tiers, same emulation) in 3 rotated
rounds. Per round, stitch's TTFT p50 is divided by longest's of the same round; the summary
(``results/stitch_emulated/summary.md``) shows those ratios, the tokens and bytes each policy
read from each tier, and output agreement. About 15 minutes on 2 cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcompose.bench.summary import paired_ratios

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "stitch_emulated"
CONTENDERS = HERE / "contenders"
WORKLOADS = {"chat": [], "docqa": ["--questions", "4"]}


def workload_summary(name: str, results: dict) -> list[str]:
    by_label = {c["label"]: c for c in results["contenders"]}
    lines = [f"## {name}: {results['meta']['workload_description']}", ""]
    lines += [
        "| contender | TTFT p50 ms by round | vs recompute, median (range) | fast tokens "
        "(MB) | slow tokens (MB) | agreement |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in ("recompute", "longest", "stitch"):
        c = by_label[label]
        if c["status"] != "ok":
            lines.append(f"| {label} | {c['status']}: {c.get('error')} | | | | |")
            continue
        stores = c["hits"]["stores"]
        tiers = []
        for tier in ("fast", "disk"):
            s = stores.get(tier, {})
            tiers.append(f"{s.get('tokens_loaded', 0):,} ({s.get('bytes_loaded', 0) / 1e6:,.0f})")
        rounds = " / ".join(f"{x * 1000:,.0f}" for x in c["ttft_p50_rounds"])
        speed = f"{c['ttft_p50_speedup']:.1f}x ({c['speedup_low']:.1f}-{c['speedup_high']:.1f})"
        lines.append(
            f"| {label} | {rounds} | {speed} | {tiers[0]} | {tiers[1]} | "
            f"{c['agreement']['percent']:.0f} % |"
        )
    stitch, longest = by_label["stitch"], by_label["longest"]
    if stitch["status"] == "ok" and longest["status"] == "ok":
        paired = paired_ratios(stitch["ttft_p50_rounds"], longest["ttft_p50_rounds"])
        lines += [
            "",
            "stitch / longest TTFT p50, paired by round: "
            + ", ".join(f"{r:.2f}" for r in paired.ratios)
            + f"; median {paired.median:.2f}.",
        ]
    return [*lines, ""]


def main(extra: list[str]) -> int:
    from kvcompose.cli.main import main as kvcompose

    rc = 0
    sections = [
        "# Stitch against longest with an emulated slow tier",
        "",
        "The disk tier's reads are EMULATED (5 ms + bytes at 0.25 GB/s per load); the fast "
        "tier is tmpfs. Tokens and MB are per replay (mean over rounds).",
        "",
    ]
    for name, args in WORKLOADS.items():
        out = OUT / name
        rc = max(
            rc,
            kvcompose(
                [
                    "bench",
                    "--workload",
                    name,
                    *args,
                    "--out",
                    str(out),
                    "-c",
                    "recompute",
                    "-c",
                    f"longest={CONTENDERS / 'kvcompose-longest-slowdisk.yaml'}",
                    "-c",
                    f"stitch={CONTENDERS / 'kvcompose-stitch-slowdisk.yaml'}",
                    *extra,
                ]
            ),
        )
        results = out / "results.json"
        if results.is_file():
            sections += workload_summary(name, json.loads(results.read_text()))
    text = "\n".join(sections)
    (OUT / "summary.md").write_text(text)
    print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
