"""How many concurrent requests a kvcompose tree sustains on the hybrid model with vLLM's hybrid
KV cache manager (HMA) on, against the same tree forced to HMA off: ``results/hma_capacity``.

    flock /tmp/kvcompose-engine.lock python benchmarks/hma_capacity.py [--repeats N]

The tree is the default comparison's ``longest`` chain over its two store tiers (every
returning user's history is in the disk tier). ``hma`` leaves ``hma`` at auto: every leaf
supports HMA, so it loads as ``KVComposeHMA`` and vLLM keeps two KV cache groups, the sliding
one holding its 256-token window only. ``hma-off`` is the same tree with ``hma: false``: vLLM
sizes every layer as full attention, one group.

Both run ``builtin-hybrid`` with the same KV cache memory (``KV_CACHE_MIB``), chosen so that
with HMA off ``BASE_USERS`` requests fit whole: a request is 1,600 prompt tokens and
``MAX_TOKENS`` output tokens, 14 blocks of 128 tokens of 4 MiB with HMA off; with HMA on its
full-attention group takes 14 blocks of 2 MiB and its sliding group the window's 3-4. Every
request arrives at once (``--time-scale 0``), one per user (``--rounds 1``), at three
concurrencies: ``BASE_USERS``, 1.5 times as many (the goal) and twice as many. ``kvcompose
bench`` runs each concurrency with both trees in rotated rounds; every row carries the blocks
vLLM allocated, whether HMA stayed on (read from the engine), the preemptions of the replay and
the most requests the scheduler ran at once (the others wait for blocks).

``summary.md`` reports, per concurrency and tree, preemptions per replay, the most requests
running at once, TTFT p50 and throughput, and ``hma-off``'s TTFT p50 and throughput over
``hma``'s (TTFT paired within each round: median and range). The goal: the HMA tree runs at
least 1.5 times the concurrent requests of the HMA-off tree without preemption.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "hma_capacity"
MODEL = "builtin-hybrid"
BASE_USERS = 8
#: the base, the goal's 1.5 times it, and twice it
LEVELS = (BASE_USERS, BASE_USERS * 3 // 2, 2 * BASE_USERS)
MAX_TOKENS = 96
#: 114 blocks of 4 MiB with HMA off: 8 requests of 14 blocks and vLLM's null block
KV_CACHE_MIB = 456
GOAL = 1.5


def contender_files(out: Path) -> dict[str, Path]:
    """The two trees: the default comparison's ``longest`` chain, HMA auto and HMA off."""
    from kvcompose.bench import contenders as cmod

    text = cmod.builtin_contender("kvcompose-longest").text
    assert text is not None
    out.mkdir(parents=True, exist_ok=True)
    files = {"hma": out / "hma.yaml", "hma-off": out / "hma-off.yaml"}
    files["hma"].write_text(text)
    files["hma-off"].write_text(text.replace("version: 1\n", "version: 1\nhma: false\n", 1))
    return files


def bench_args(users: int, files: dict[str, Path]) -> list[str]:
    args = ["bench", "--model", MODEL, "--workload", "chat", "--users", str(users)]
    args += ["--new-users", "0", "--rounds", "1", "--time-scale", "0"]
    args += ["--max-tokens", str(MAX_TOKENS), "--max-num-seqs", str(2 * users)]
    args += ["--kv-cache-mib", str(KV_CACHE_MIB)]
    for label, path in files.items():
        args += ["-c", f"{label}={path}"]
    return args


def _load(path: Path) -> Any:
    from kvcompose.bench.results import BenchResults

    return BenchResults.model_validate_json(path.read_text())


def _paired(num: list[float], den: list[float]) -> tuple[float, float, float] | None:
    from kvcompose.bench.summary import paired_ratios

    if not num or len(num) != len(den):
        return None
    p = paired_ratios(num, den)
    return (p.median, p.low, p.high) if p.ratios else None


def write_summary(out: Path) -> str:
    """``summary.md`` from each concurrency's ``results.json`` under ``out/users<N>``."""
    rows, sustained = [], {"hma": 0, "hma-off": 0}
    for users in LEVELS:
        results = _load(out / f"users{users}" / "results.json")
        by = {c.label: c for c in results.contenders}
        for label in ("hma", "hma-off"):
            c = by[label]
            if not c.ran:
                rows.append(f"| {users} | {label} | failed: {c.error} | | | | | | |")
                continue
            kv = c.kv_cache
            lat, thr = c.latency, c.throughput
            if c.preemptions == 0 and c.peak_running:
                sustained[label] = max(sustained[label], c.peak_running)
            rows.append(
                f"| {users} | {label} | {kv.num_blocks:,} ({len(kv.groups)}) | "
                f"{'on' if kv.hma else 'off'} | {c.preemptions:g} | {c.peak_running} | "
                f"{lat.ttft_p50_s * 1000:,.0f} | {thr.total_tokens_per_s:,.0f} | "
                f"{c.agreement.percent if c.agreement else '-'} |"
            )
        if by["hma"].ran and by["hma-off"].ran:
            ratio = _paired(by["hma-off"].ttft_p50_rounds, by["hma"].ttft_p50_rounds)
            on, off = (by[k].throughput.total_tokens_per_s for k in ("hma", "hma-off"))
            rows.append(
                f"| {users} | hma-off / hma | | | | | "
                + (f"{ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f})" if ratio else "-")
                + f" | {off / on:.2f} | |"
            )
    meta = _load(out / f"users{LEVELS[0]}" / "results.json").meta
    factor = sustained["hma"] / sustained["hma-off"] if sustained["hma-off"] else None
    lines = [
        "# Concurrent requests with HMA on and off, the same kvcompose tree",
        "",
        f"`python benchmarks/hma_capacity.py`: `{MODEL}`, {KV_CACHE_MIB} MiB of KV cache, "
        f"{meta.repeats} rounds per concurrency (the two trees' order rotated), every request "
        f"at once: one per user, 1,600 prompt tokens (1,536 of them in the disk tier), "
        f"{MAX_TOKENS} output tokens. KV blocks, groups and HMA are read from each engine; "
        "preemptions are per replay (mean over rounds); the ratio rows are hma-off's over "
        "hma's, TTFT p50 paired within each round (median and range), throughput of the "
        "pooled rounds.",
        "",
        "| users | tree | KV blocks (groups) | HMA | preemptions | most running at once | "
        "TTFT p50 ms | tokens/s | agreement % |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Most requests running at once in a replay without preemption (of "
        f"{', '.join(map(str, LEVELS))} users): "
        f"hma {sustained['hma']}, hma-off {sustained['hma-off']}"
        + (f", {factor:.2f}x" if factor else "")
        + f"; goal at least {GOAL}x: "
        + ("met" if factor is not None and factor >= GOAL else "NOT met"),
    ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    return text


def main(argv: list[str]) -> int:
    from kvcompose.cli.main import main as cli

    files = contender_files(OUT / "trees")
    rc = 0
    for users in LEVELS:
        args = [*bench_args(users, files), "--out", str(OUT / f"users{users}"), *argv]
        rc = max(rc, cli(args))
    print(write_summary(OUT))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
