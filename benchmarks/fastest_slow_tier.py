"""``policy: fastest`` where a tier is slower than computing (issue 27's slow-tier comparison).

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/fastest_slow_tier.py [bench flags]

The default chat workload's two tiers, with the disk tier's reads **emulated** as a tier slower
than this CPU's prefill (``emulate_read: {latency_ms: 20, gbps: 0.03}``; about 50 MB/s of KV
is what the engine computes here). Contenders, in rotated rounds:

- ``recompute``; the disk tier alone; chain ``longest`` and ``stitch`` over [fast, disk];
- the fast tier alone (the shared system prompts loaded, the rest recomputed): the best
  fixed plan when the disk tier is slower than computing, which no other policy can choose;
- chain ``fastest`` over [fast, disk], with no prior set: it starts from the default prior
  (1 ms + 1 GB/s, so its first loads from disk are taken) and learns the disk tier's speed.

Per round, each contender's TTFT p50 and p90 are paired with the best fixed plan's and
recompute's of the same round (``results/fastest_slow_tier/summary.md``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcompose.bench.summary import paired_ratios

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "fastest_slow_tier"
CONTENDERS = HERE / "contenders"
FIXED = ("recompute", "disk", "longest", "stitch", "fast-only")


def summary(results: dict) -> list[str]:
    by_label = {c["label"]: c for c in results["contenders"]}
    lines = [
        f"Workload: {results['meta']['workload_description']}",
        "",
        "| contender | TTFT p50 ms by round | TTFT p90 ms by round | vs recompute, median "
        "(range) | fast tokens | disk tokens | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in (*FIXED, "fastest"):
        c = by_label.get(label)
        if c is None or c["status"] != "ok":
            lines.append(f"| {label} | {c and c['status']} | | | | | |")
            continue
        stores = c["hits"]["stores"]
        tiers = [f"{stores.get(t, {}).get('tokens_loaded', 0):,}" for t in ("fast", "disk")]
        p50 = " / ".join(f"{x * 1000:,.0f}" for x in c["ttft_p50_rounds"])
        p90 = " / ".join(f"{x * 1000:,.0f}" for x in c.get("ttft_p90_rounds", []))
        speed = f"{c['ttft_p50_speedup']:.1f}x ({c['speedup_low']:.1f}-{c['speedup_high']:.1f})"
        lines.append(
            f"| {label} | {p50} | {p90} | {speed} | {tiers[0]} | {tiers[1]} | "
            f"{c['agreement']['percent']:.0f} % |"
        )
    fastest = by_label.get("fastest")
    if fastest is None or fastest["status"] != "ok":
        return lines
    lines.append("")
    for label in FIXED:
        other = by_label.get(label)
        if other is None or other["status"] != "ok":
            continue
        paired = paired_ratios(fastest["ttft_p50_rounds"], other["ttft_p50_rounds"])
        lines.append(
            f"- fastest / {label}, TTFT p50 paired by round: "
            + ", ".join(f"{r:.2f}" for r in paired.ratios)
            + f" (median {paired.median:.2f})"
        )
    recompute = by_label.get("recompute")
    if recompute and recompute["status"] == "ok" and "ttft_p90_rounds" in fastest:
        paired = paired_ratios(fastest["ttft_p90_rounds"], recompute["ttft_p90_rounds"])
        lines.append(
            "- fastest / recompute, TTFT p90 paired by round: "
            + ", ".join(f"{r:.2f}" for r in paired.ratios)
        )
    return lines


def main(extra: list[str]) -> int:
    from kvcompose.cli.main import main as kvcompose

    args = ["bench", "--out", str(OUT), "-c", "recompute"]
    for label, name in (
        ("disk", "slowtier-disk"),
        ("longest", "slowtier-longest"),
        ("stitch", "slowtier-stitch"),
        ("fast-only", "slowtier-fast-only"),
        ("fastest", "slowtier-fastest"),
    ):
        args += ["-c", f"{label}={CONTENDERS / (name + '.yaml')}"]
    rc = kvcompose([*args, *extra])
    results = OUT / "results.json"
    if results.is_file():
        text = "\n".join(
            [
                "# fastest against fixed plans, the disk tier EMULATED slower than computing",
                "",
                "The disk tier's reads are EMULATED (20 ms + bytes at 0.03 GB/s per load); the "
                "fast tier is tmpfs. Tokens are per replay (mean over rounds).",
                "",
                *summary(json.loads(results.read_text())),
            ]
        )
        (OUT / "summary.md").write_text(text + "\n")
        print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
