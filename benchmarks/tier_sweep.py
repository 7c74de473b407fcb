"""Admission rules for the fast tier, swept with ``tier_sim.py``'s model of
``mooncake_tiers.py``'s two tiers, and the model checked against the engine.

``--validate``: simulated against measured per-tier hit tokens and bytes written, for every
committed ``mooncake_tiers`` run. ``--sweep``: every rule of :func:`sweep_rules` on the
engine's 25-request samples (``--seeds`` of them), three 200-request and one 2,000-request
sample of each trace, the fast tier at a fifth of each sample's working set; fast-tier bytes
written, fast-tier and total hit tokens against plain ``longest`` on the same sample.

Run: ``.venv/bin/python benchmarks/tier_sweep.py --validate --sweep`` (about a minute and a
half; writes ``benchmarks/results/tier_sim/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mooncake_tiers import HERE, TRACE, Scaled, read, sample, scale, working_set_bytes
from tier_sim import CHUNK_FILE_BYTES, Config, Rule, config_of, simulate

SYNTHETIC = TRACE.with_name("synthetic_trace.jsonl")
SYNTH_DIR = "mooncake_tiers_synthetic"
OUT = HERE / "results" / "tier_sim"


def engine_sample(results_dir: Path) -> tuple[list[Scaled], int]:
    """The requests and fast-tier cap of a ``mooncake_tiers`` sample (``sample.json``)."""
    info = json.loads((results_dir / "sample.json").read_text())
    rows = read(Path(info["trace"]))
    return scale(rows, info["trace_indices"]), info["fast_max_bytes"]


def compare(results_dir: Path, results: Path, evict: str | None = None) -> list[dict[str, Any]]:
    """Per contender of the bench's ``results`` (on the sample in ``results_dir``): measured
    and simulated hit tokens and bytes written per tier. ``evict`` overrides every
    configuration's eviction timing (runs made before background stores evicted between
    steps evicted on the writer thread, right after writing)."""
    reqs, cap = engine_sample(results_dir)
    engine = json.loads(results.read_text())
    out = []
    for c in engine["contenders"]:
        config = config_of(c)
        if config is None:
            continue
        if evict is not None and config.background:
            config = replace(config, evict=evict)
        stores = (c.get("hits") or {}).get("stores") or {}
        sim = simulate(reqs, config, cap, as_bench=True)
        row: dict[str, Any] = {"label": c["label"]}
        for tier in ("fast", "slow"):
            measured, simulated = stores.get(tier, {}), sim.get(tier, {})
            row[tier] = {
                "hit_tokens": (measured.get("tokens_loaded", 0), simulated.get("hit_tokens", 0)),
                "bytes_written": (
                    measured.get("bytes_written", 0),
                    simulated.get("bytes_written", 0),
                ),
            }
        out.append(row)
    return out


def validate(results_dir: Path, results: Path, evict: str | None = None) -> list[str]:
    """``compare`` as a Markdown table (``*``: simulated differs from measured)."""
    reqs, cap = engine_sample(results_dir)
    lines = [
        f"`{results.relative_to(HERE)}` ({len(reqs)} requests, fast tier "
        f"{cap / 2**20:.0f} MiB = {cap // CHUNK_FILE_BYTES} chunks):",
        "",
        "| configuration | hit tokens fast: engine | sim | slow: engine | sim "
        "| MiB written fast: engine | sim | slow: engine | sim |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in compare(results_dir, results, evict):
        cells = []
        for metric, unit in (("hit_tokens", 1), ("bytes_written", 2**20)):
            for tier in ("fast", "slow"):
                measured, simulated = (v / unit for v in row[tier][metric])
                mark = "" if round(measured) == round(simulated) else " *"
                cells += [f"{measured:,.0f}", f"{simulated:,.0f}{mark}"]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


@dataclass(frozen=True)
class Sample:
    label: str
    trace: Path
    requests: int
    seed: int


def sample_requests(s: Sample, cache: dict[Path, list[dict[str, Any]]]) -> list[Scaled]:
    if s.trace not in cache:
        cache[s.trace] = read(s.trace)
    rows = cache[s.trace]
    return scale(rows, sample(rows, s.requests, s.seed))


def sweep_rules() -> list[tuple[str, Config]]:
    """The baseline (plain ``longest``) first, then admission rules with and without
    promotion, and the same under ``stitch``."""
    rules = [Rule()]
    for seen in (2, 3, 4):
        rules.append(Rule(min_seen=seen))
    for lo in (512, 1024, 1536):
        rules.append(Rule(min_prompt_tokens=lo))
        rules.append(Rule(min_seen=2, min_prompt_tokens=lo))
    for hi in (512, 1024, 1536):
        rules.append(Rule(max_prompt_tokens=hi))
        rules.append(Rule(min_seen=2, max_prompt_tokens=hi))
    rules += [Rule(after_hit=True), Rule(tinylfu=True), Rule(oracle=True)]
    out = []
    for policy in ("longest", "stitch"):
        for r in rules:
            for promote in (False, True):
                if promote and r == Rule():
                    continue  # promotion without admission saves what write-through saves
                rule = replace(r, promote=promote)
                out.append((f"{policy}: {rule.label()}", Config(policy, rule)))
    return out


def frontier(samples: list[Sample]) -> dict[str, Any]:
    """Every rule on every sample: fast MiB written, fast and total hit tokens, each also
    relative to plain ``longest`` on the same sample."""
    cache: dict[Path, list[dict[str, Any]]] = {}
    rules = sweep_rules()
    table: dict[str, dict[str, Any]] = {}
    for s in samples:
        reqs = sample_requests(s, cache)
        cap = working_set_bytes(reqs) // 5
        results = [simulate(reqs, config, cap) for _, config in rules]
        base = results[0]  # plain longest
        base_fast = base["fast"]["hit_tokens"]
        base_total = base_fast + base["slow"]["hit_tokens"]
        base_bytes = base["fast"]["bytes_written"]
        for (label, _), r in zip(rules, results, strict=True):
            fast, total = r["fast"]["hit_tokens"], r["fast"]["hit_tokens"] + r["slow"]["hit_tokens"]
            row = table.setdefault(label, {})
            row[s.label] = {
                "fast_mib": r["fast"]["bytes_written"] / 2**20,
                "fast_hits": fast,
                "total_hits": total,
                "write_cut": 1 - r["fast"]["bytes_written"] / max(base_bytes, 1),
                "fast_hit_loss": 1 - fast / max(base_fast, 1),
                "total_hit_loss": 1 - total / max(base_total, 1),
            }
    return table


def markdown(table: dict[str, Any], groups: dict[str, list[str]]) -> list[str]:
    """One row per rule, per sample group: fast-tier writes, fast-tier hit tokens and total
    hit tokens against plain ``longest`` on the same sample (medians over a group's
    samples); ``**`` marks writes cut by half or more at under 5 % fewer fast-tier hits."""
    head = "| rule | " + " | ".join(f"{g}: fast writes | fast hits | all hits" for g in groups)
    lines = [head + " |", "|---|" + "---:|---:|---:|" * len(groups)]
    for label, by_sample in table.items():
        cells = []
        for names in groups.values():
            rows = [by_sample[n] for n in names]
            cut = statistics.median(r["write_cut"] for r in rows)
            fl = statistics.median(r["fast_hit_loss"] for r in rows)
            tl = statistics.median(r["total_hit_loss"] for r in rows)
            mark = " **" if cut >= 0.5 and fl < 0.05 else ""
            cells += [f"{-100 * cut:+.0f} %{mark}", f"{-100 * fl:+.0f} %", f"{-100 * tl:+.0f} %"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def absolute(table: dict[str, Any], names: list[str]) -> list[str]:
    """Fast MiB written, fast-tier and total hit tokens per rule on single samples."""
    head = "| rule | " + " | ".join(f"{n}: fast MiB | fast hits | all hits" for n in names)
    lines = [head + " |", "|---|" + "---:|---:|---:|" * len(names)]
    for label, by_sample in table.items():
        cells = []
        for n in names:
            r = by_sample[n]
            cells += [f"{r['fast_mib']:,.0f}", f"{r['fast_hits']:,}", f"{r['total_hits']:,}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="against the committed engine runs")
    ap.add_argument("--sweep", action="store_true", help="admission rules' frontier")
    ap.add_argument("--seeds", type=int, default=10, help="25-request samples per trace")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.validate:
        conv, synth = HERE / "results" / "mooncake_tiers", HERE / "results" / SYNTH_DIR
        lines = []
        for results in sorted(conv.glob("**/*results.json")):
            lines += [*validate(conv, results), ""]
        lines += [*validate(synth, synth / "bench" / "results.json"), ""]
        text = "\n".join(lines)
        (args.out / "validation.md").write_text(text)
        print(text)
    if args.sweep:
        samples: list[Sample] = []
        groups: dict[str, dict[str, list[str]]] = {}
        for name, trace in (("conversation", TRACE), ("synthetic", SYNTHETIC)):
            for n, seeds in ((25, range(args.seeds)), (200, range(3)), (2000, range(1))):
                group = f"{n}" + (f" x{len(seeds)}" if len(seeds) > 1 else "")
                for seed in seeds:
                    s = Sample(f"{name}/{n}/{seed}", trace, n, seed)
                    samples.append(s)
                    groups.setdefault(name, {}).setdefault(group, []).append(s.label)
        table = frontier(samples)
        lines = []
        for name, by_group in groups.items():
            lines += [f"### {name} trace, against plain `longest`", ""]
            lines += [*markdown(table, by_group), ""]
        lines += ["### The engine's samples (seed 0, 25 requests)", ""]
        lines += absolute(table, ["conversation/25/0", "synthetic/25/0"])
        text = "\n".join(lines)
        (args.out / "frontier.md").write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
