"""A kvcompose chain of one child against that child called directly.

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/one_child.py [bench args]

runs ``kvcompose bench`` on the default chat workload with three contenders in rotated rounds
(default 5): ``recompute``, ``disk`` (one PrefixStoreConnector, vLLM loads it directly) and
``kvcompose-one`` (``contenders/kvcompose-one-disk.yaml``: a kvcompose chain whose only child
is the same connector on an identical copy of the same prepared store). Same engine settings,
same prompts, same tokens loaded. Per round, ``kvcompose-one``'s TTFT p50 is divided by
``disk``'s TTFT p50 *of the same round* (they ran minutes apart, in rotated order); the
summary reports those paired ratios, their median and range, and whether the range contains
1.0 (composition costs nothing measurable). Results go to ``benchmarks/results/one_child/``
(``results.json`` and ``results.csv`` from the bench, ``paired.md`` from this script).
About 8 minutes on 2 cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvcompose.bench.summary import paired_ratios

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "one_child"
CONTENDER = HERE / "contenders" / "kvcompose-one-disk.yaml"


def paired_summary(results: dict) -> str:
    """The per-round TTFT p50 ratio kvcompose-one / disk, as Markdown."""
    by_label = {c["label"]: c for c in results["contenders"]}
    one, disk = by_label["kvcompose-one"], by_label["disk"]
    if one["status"] != "ok" or disk["status"] != "ok":
        return f"not measured: kvcompose-one {one['status']}, disk {disk['status']}\n"
    pairs = list(zip(one["ttft_p50_rounds"], disk["ttft_p50_rounds"], strict=True))
    paired = paired_ratios(one["ttft_p50_rounds"], disk["ttft_p50_rounds"])
    med, lo, hi = paired.median, paired.low, paired.high
    verdict = (
        "the range contains 1.0: no cost measurable at this noise"
        if lo <= 1.0 <= hi
        else ("kvcompose-one slower in every round" if lo > 1.0 else "kvcompose-one faster")
    )
    agree = one["agreement"]["percent"], disk["agreement"]["percent"]
    loaded = one["hits"]["tokens_loaded"], disk["hits"]["tokens_loaded"]
    lines = [
        "# A kvcompose chain of one child against the child called directly",
        "",
        f"{results['meta']['started']}, {results['meta']['machine']['cpus']} CPUs, vLLM "
        f"{results['meta']['vllm']}, {len(pairs)} rounds (order rotated), workload "
        f"{results['meta']['workload_description']}.",
        "",
        "| round | disk TTFT p50 ms | kvcompose-one TTFT p50 ms | kvcompose-one / disk |",
        "|---:|---:|---:|---:|",
        *(
            f"| {i + 1} | {b * 1000:.0f} | {a * 1000:.0f} | {a / b:.3f} |"
            for i, (a, b) in enumerate(pairs)
        ),
        "",
        f"Paired ratio kvcompose-one / disk: median {med:.3f}, range {lo:.3f} to {hi:.3f}; "
        f"{verdict}.",
        f"Tokens loaded per replay: kvcompose-one {loaded[0]:,}, disk {loaded[1]:,}; "
        f"greedy output agreement with recompute: {agree[0]:.0f} % / {agree[1]:.0f} %.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    from kvcompose.cli.main import main

    args = [
        "bench",
        "--out",
        str(OUT),
        "--repeats",
        "5",
        "-c",
        "recompute",
        "-c",
        "builtin:disk",
        "-c",
        f"kvcompose-one={CONTENDER}",
        *sys.argv[1:],
    ]
    rc = main(args)
    results_file = OUT / "results.json"
    if results_file.is_file():
        summary = paired_summary(json.loads(results_file.read_text()))
        (OUT / "paired.md").write_text(summary)
        print(summary)
    raise SystemExit(rc)
