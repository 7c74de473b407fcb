"""``policy: fastest`` where a tier is slower than computing (the slow-tier comparison).

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/fastest_slow_tier.py [bench flags]

The default chat workload's two tiers, with the disk tier's reads **emulated** as a tier slower
than the CPU's prefill (``emulate_read: {latency_ms: 20, gbps: 0.03}``; the machine these
results were first measured on computed 1,500-2,000 tokens/s, some 50-65 MB/s of KV; on one
that computes about 1,000 tokens/s the tier is about at par with computing, and the plans
lie closer together: benchmarks/README.md). Contenders, in rotated rounds:

- ``recompute``; the disk tier alone; chain ``longest`` and ``stitch`` over [fast, disk];
- the fast tier alone (the shared system prompts loaded, the rest recomputed): the best
  fixed plan when the disk tier is slower than computing, which no other policy can choose;
- chain ``fastest`` over [fast, disk], with no prior set: it starts from the default prior
  (1 ms + 1 GB/s), so the disk tier is cold: its first load is a 128-token probe, alone, and
  from its times on ``fastest`` goes by the disk tier's measured speed;
- ``fastest-fast-told``: the same with the fast tier's speed stated as a prior (``expect_read``,
  as the default comparison states both local tiers'), the disk tier cold: only the tier
  whose speed is unknown is probed;
- ``fastest-told``: both tiers' speeds stated (the disk tier's as the emulation's numbers):
  nothing is probed, so its gap to the fast tier alone is what the chain costs without
  probing (the disk tier's writes, the plan choice), and the cold contenders' further gap is
  their probes'.

Per round, each contender's TTFT p50 and p90 are paired with the best fixed plan's and
recompute's of the same round, the cold contenders' p50 also with the control's (what their
probes cost: ``control_lines``), and every request of recompute, fast-only and the ``fastest``
contenders is listed with its TTFT and tokens loaded (``results/fastest_slow_tier/summary.md``).
``--summary-only`` rewrites ``summary.md`` from the run already in the results directory.

``--saturation``: the same contenders with every request arriving at once (``--time-scale 0``)
and 10 users, so that loads pile up on the slow tier; the summary adds TTFT p99 per round,
paired with recompute's (``results/fastest_saturation/summary.md``).
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvcompose.bench.summary import paired_ratios

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "fastest_slow_tier"
SATURATION = HERE / "results" / "fastest_saturation"
CONTENDERS = HERE / "contenders"
FIXED = ("recompute", "disk", "longest", "stitch", "fast-only")
#: ``fastest`` with no prior, with the fast tier's speed stated (the disk tier cold), and with
#: both tiers' speeds stated (nothing probed)
CHOSEN = ("fastest", "fastest-fast-told", "fastest-told")
#: The control: both speeds stated, so nothing is probed and every request takes the fast tier
#: alone's plan; the cold contenders take it too once their probes are done.
CONTROL = "fastest-told"


def summary(
    results: dict, fixed: tuple[str, ...] = FIXED, chosen: tuple[str, ...] = ("fastest",)
) -> list[str]:
    """The table of contenders (``fixed`` then ``chosen``) and each of ``chosen``'s TTFT
    paired by round with each fixed plan's (also used by ``fastest_mixed.py``)."""
    by_label = {c["label"]: c for c in results["contenders"]}
    lines = [
        f"Workload: {results['meta']['workload_description']}",
        "",
        "| contender | TTFT p50 ms by round | TTFT p90 ms by round | vs recompute, median "
        "(range) | fast tokens | disk tokens | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in (*fixed, *chosen):
        c = by_label.get(label)
        if c is None:
            continue  # not in this run (a run of some of the contenders)
        if c["status"] != "ok":
            lines.append(f"| {label} | {c['status']} | | | | | |")
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
    recompute = by_label.get("recompute")
    for name in chosen:
        mine = by_label.get(name)
        if mine is None or mine["status"] != "ok":
            continue
        lines.append("")
        for label in fixed:
            other = by_label.get(label)
            if other is None or other["status"] != "ok":
                continue
            lines.append(_p50_line(f"{name} / {label}", mine, other))
        if recompute and recompute["status"] == "ok" and "ttft_p90_rounds" in mine:
            paired = paired_ratios(mine["ttft_p90_rounds"], recompute["ttft_p90_rounds"])
            lines.append(
                f"- {name} / recompute, TTFT p90 paired by round: "
                + ", ".join(f"{r:.2f}" for r in paired.ratios)
            )
    return lines


def _p50_line(pair: str, mine: dict, other: dict) -> str:
    """``- A / B, TTFT p50 paired by round: ...`` for contenders ``mine`` and ``other``."""
    paired = paired_ratios(mine["ttft_p50_rounds"], other["ttft_p50_rounds"])
    ratios = ", ".join(f"{r:.2f}" for r in paired.ratios)
    return f"- {pair}, TTFT p50 paired by round: {ratios} (median {paired.median:.2f})"


def control_lines(results: dict) -> list[str]:
    """The cold contenders' TTFT p50 paired by round with the control's (``CONTROL``): what
    their probes cost. The control runs the same chain and differs only in what it was told,
    so the pairing leaves out the chain's own work (the disk tier's writes, the lookups),
    which the pairing with the fast tier alone counts. Like every pairing here it also holds
    whatever the machine's speed did between the two contenders' turns in a round: runs of
    the same plan differ by several per cent (benchmarks/README.md, "On a slower machine"
    and "Five rounds")."""
    by_label = {c["label"]: c for c in results["contenders"]}
    control = by_label.get(CONTROL)
    if control is None or control["status"] != "ok":
        return []
    lines = [""]
    for name in CHOSEN:
        mine = by_label.get(name)
        if name == CONTROL or mine is None or mine["status"] != "ok":
            continue
        lines.append(_p50_line(f"{name} / {CONTROL} (the control)", mine, control))
    return lines if len(lines) > 1 else []


def tail_lines(requests_csv: Path, pct: float = 99) -> list[str]:
    """Each contender's TTFT ``pct``-th percentile per round (from the per-request rows), and
    ``fastest``'s and ``longest``'s paired by round with recompute's."""
    ttfts: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with requests_csv.open() as fh:
        for row in csv.DictReader(fh):
            if row["ttft_s"]:
                ttfts[row["contender"]][f"{row['seed']}/{row['round']}"].append(
                    float(row["ttft_s"])
                )
    tails = {
        c: {r: float(np.percentile(v, pct)) for r, v in rounds.items()}
        for c, rounds in ttfts.items()
    }
    lines = ["", f"| contender | TTFT p{pct:g} ms by round |", "|---|---:|"]
    for c, by_round in tails.items():
        lines.append(f"| {c} | {' / '.join(f'{v * 1000:,.0f}' for v in by_round.values())} |")
    lines.append("")
    for c in (*CHOSEN, "longest"):
        if c in tails and "recompute" in tails:
            paired = paired_ratios(tails[c], tails["recompute"])
            lines.append(
                f"- {c} / recompute, TTFT p{pct:g} paired by round: "
                + ", ".join(f"{r:.2f}" for r in paired.ratios)
            )
    return lines


def request_lines(requests_csv: Path, labels: tuple[str, ...]) -> list[str]:
    """Each of ``labels``' requests, per round, in replay order: TTFT in ms and the tokens
    loaded (vLLM's cached tokens). Where a cold contender's probes land, and how far apart
    two contenders with the same plan are, is only seen request by request; the rows are
    not committed (``requests.csv``), so the summary keeps them."""
    by: dict[tuple[str, str], list[str]] = defaultdict(list)
    with requests_csv.open() as fh:
        for row in csv.DictReader(fh):
            if row["contender"] in labels and row["ttft_s"]:
                cell = f"{float(row['ttft_s']) * 1000:,.0f} ({row['cached_tokens']})"
                by[row["contender"], f"{row['seed']}/{row['round']}"].append(cell)
    if not by:
        return []
    width = max(len(cells) for cells in by.values())
    lines = [
        "",
        "Per request, in replay order: TTFT ms (tokens loaded).",
        "",
        "| contender | seed/round | " + " | ".join(f"#{i + 1}" for i in range(width)) + " |",
        "|---|---|" + "---:|" * width,
    ]
    for label in labels:
        for (c, rnd), cells in sorted(by.items()):
            if c == label:
                lines.append(f"| {c} | {rnd} | " + " | ".join(cells) + " |")
    return lines


def write_summary(out: Path, saturation: bool) -> str | None:
    """``summary.md`` from the run's ``results.json`` and ``requests.csv`` in ``out``."""
    results = out / "results.json"
    if not results.is_file():
        return None
    requests = out / "requests.csv"
    text = "\n".join(
        [
            "# fastest against fixed plans, the disk tier EMULATED slower than computing"
            + (": saturation (every request at once)" if saturation else ""),
            "",
            "The disk tier's reads are EMULATED (20 ms + bytes at 0.03 GB/s per load); the "
            "fast tier is tmpfs. Tokens are per replay (mean over rounds).",
            "",
            *summary(run := json.loads(results.read_text()), chosen=CHOSEN),
            *control_lines(run),
            *(tail_lines(requests) if saturation else []),
            *(
                request_lines(requests, ("recompute", "fast-only", *CHOSEN))
                if requests.is_file() and not saturation
                else []
            ),
        ]
    )
    (out / "summary.md").write_text(text + "\n")
    return text


def main(extra: list[str]) -> int:
    from kvcompose.cli.main import main as kvcompose

    saturation = "--saturation" in extra
    out = SATURATION if saturation else OUT
    if "--summary-only" in extra:  # rewrite summary.md from the run already there
        return 0 if write_summary(out, saturation) is not None else 1
    if saturation:
        extra = [a for a in extra if a != "--saturation"] + ["--time-scale", "0", "--users", "10"]
    args = ["bench", "--out", str(out), "-c", "recompute"]
    for label, name in (
        ("disk", "slowtier-disk"),
        ("longest", "slowtier-longest"),
        ("stitch", "slowtier-stitch"),
        ("fast-only", "slowtier-fast-only"),
        ("fastest", "slowtier-fastest"),
        ("fastest-fast-told", "slowtier-fastest-fast-told"),
        ("fastest-told", "slowtier-fastest-told"),
    ):
        args += ["-c", f"{label}={CONTENDERS / (name + '.yaml')}"]
    rc = kvcompose([*args, *extra])
    text = write_summary(out, saturation)
    if text is not None:
        print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
