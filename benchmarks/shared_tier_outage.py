"""Requests while the shared tier's Mooncake master is down: where the time goes, and what
outlier ejection (a child's ``eject`` rule) does to it.

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/shared_tier_outage.py

Each contender runs on a fresh bed (``kvcompose.testing.mooncake.MooncakeCluster``: master,
pool, one engine with ``chain/stitch [local, shared]``; ``recompute`` is an engine without a
connector): ``--warm`` requests with the master up, then the master is killed (SIGKILL) and
``--requests`` fresh prompts run one after another. Per request: its wall time, and where the
engine spent it, from inside the engine: the shared leaf's scheduler lookup
(``get_num_new_matched_tokens``, called inside ``Scheduler.schedule``), the whole engine step,
the model's forward, and Mooncake's own per-operation seconds (``lookup_exists``,
``save_exists``, ``save_put``, ``load_get``: its worker threads). Outputs are compared with
recompute's in the same round.

Contenders:

- ``recompute``: no connector;
- ``no-rule``: the shared leaf without an ejection rule;
- ``eject``: the leaf with ``eject: {failures: 1, slow_ms: 500, backoff_s: 30}``;
- ``eject-async``: the same rule, the leaf's lookups async (``lookup_async: true``) and the
  chain's ``lookup_timeout_s: 0.5`` (no lookup holds the engine step; a request waits for
  the shared tier at most that long).

Rounds rotate the contenders' order. Results: ``results/shared_tier_outage/results.json`` and
``summary.md`` (per contender and round: p50, mean and max request time during the outage;
p50 and mean paired by round against recompute's).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvcompose.bench.run import round_order
from kvcompose.bench.summary import paired_ratios
from kvcompose.engine.model import build_tiny_model, default_cache_dir
from kvcompose.testing.mooncake import MooncakeCluster, node_counters, store_operations
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

OUT = Path(__file__).parent / "results" / "shared_tier_outage"
BLOCK = 32
PROMPT_TOKENS = 512
MAX_TOKENS = 16
LLM_KWARGS = {"block_size": BLOCK, "enable_prefix_caching": False, "max_model_len": 1024}
RULE = {"failures": 1, "slow_ms": 500, "backoff_s": 30}
CONTENDERS: dict[str, dict[str, Any]] = {
    "recompute": {},
    "no-rule": {"leaf": {}},
    "eject": {"leaf": {"fields": {"eject": RULE}}},
    "eject-async": {
        "leaf": {"lookup_async": True, "fields": {"eject": RULE}},
        "chain": {"lookup_timeout_s": 0.5},
    },
}

# ----------------------------------------------------------------- inside the engine
_TIMES: dict[str, list[float]] = defaultdict(list)


def _timed(obj: Any, method: str, key: str) -> None:
    fn = getattr(obj, method)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES[key].append(time.perf_counter() - start)

    setattr(obj, method, timed)


def instrument(llm: Any, leaf: str | None) -> None:
    """(In the engine) time the engine step, the forward and the leaf's scheduler lookup."""
    from kvcompose.engine.probe import engine_core, scheduler_connector, walk_connectors

    core = engine_core(llm)
    _timed(core, "step_fn", "step")
    _timed(core.model_executor, "execute_model", "forward")
    if leaf is None:
        return
    nodes = list(walk_connectors(scheduler_connector(llm)))
    shared = next(n.connector for n in nodes if n.name == leaf)
    _timed(shared, "get_num_new_matched_tokens", "lookup")
    for node in nodes:  # kvcompose nodes cache their children's bound methods
        side = getattr(node.connector, "scheduler_side", None)
        if side is not None:
            side.refresh_child_methods()


def take_times(llm: Any) -> dict[str, float]:
    """(In the engine) seconds per timed part since the last call."""
    out = {k: round(sum(v), 4) for k, v in _TIMES.items()}
    _TIMES.clear()
    return out


# ----------------------------------------------------------------------- the driver
def _ops_seconds(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, entry in after.items():
        seconds = entry["seconds"] - before.get(key, {}).get("seconds", 0.0)
        if seconds > 0:
            out[key] = round(seconds, 4)
    return out


def run_contender(
    name: str, model: Path, work: Path, seed: int, warm: int, requests: int
) -> dict[str, Any]:
    spec = CONTENDERS[name]
    prompts = [prompt(PROMPT_TOKENS, seed + i) for i in range(warm + requests)]
    with MooncakeCluster(work / "mooncake") as cluster:
        if "leaf" in spec:
            leaf_kw = dict(spec["leaf"])
            tree = chain(
                "tiers",
                prefix_store_leaf("local", work / "local"),
                cluster.leaf("shared", **leaf_kw),
                policy="stitch",
                **spec.get("chain", {}),
            )
            cfg = kvcompose_config(tree, kv_load_failure_policy="recompute")
            engine = cluster.engine(name, model, cfg, llm_kwargs=LLM_KWARGS)
        else:
            engine = cluster.engine(name, model, None, llm_kwargs=LLM_KWARGS)
        engine.call(instrument, "shared" if "leaf" in spec else None)
        for p in prompts[:warm]:
            engine.generate([p], MAX_TOKENS)
        time.sleep(0.5)  # the warm requests' saves reach the pool
        engine.call(take_times)
        cluster.kill_master()
        rows = []
        for p in prompts[warm:]:
            ops_before = engine.call(store_operations) if "leaf" in spec else {}
            start = time.perf_counter()
            out = engine.generate([p], MAX_TOKENS)[0][0]
            wall = time.perf_counter() - start
            parts = engine.call(take_times)
            ops = _ops_seconds(engine.call(store_operations), ops_before) if "leaf" in spec else {}
            rows.append({"wall_s": round(wall, 4), "parts_s": parts, "mooncake_s": ops, "out": out})
        counters = engine.call(node_counters) if "leaf" in spec else {}
    return {"requests": rows, "counters": counters}


def summarize(results: dict[str, Any]) -> str:
    rounds = results["rounds"]
    names = list(CONTENDERS)
    lines = [
        "# Requests while the Mooncake master is down",
        "",
        f"{results['requests']} fresh {PROMPT_TOKENS}-token prompts one after another per "
        f"contender after the master was killed ({MAX_TOKENS} tokens each, block size "
        f"{BLOCK}, tiny Llama, one engine on 2 cores), {len(rounds)} rounds in rotated order.",
        "",
        "| contender | p50 s by round | mean s by round | max s by round | p50 vs recompute "
        "| mean vs recompute | outputs equal | ejections / skipped lookups |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    p50 = {n: {} for n in names}
    means = {n: {} for n in names}
    for r, run in enumerate(rounds):
        for n in names:
            walls = [row["wall_s"] for row in run[n]["requests"]]
            p50[n][r] = statistics.median(walls)
            means[n][r] = statistics.fmean(walls)
    for n in names:
        walls = [[row["wall_s"] for row in run[n]["requests"]] for run in rounds]
        ref = [[row["out"] for row in run["recompute"]["requests"]] for run in rounds]
        outs = [[row["out"] for row in run[n]["requests"]] for run in rounds]
        pairs = [zip(o, rf, strict=True) for o, rf in zip(outs, ref, strict=True)]
        equal = sum(a == b for pair in pairs for a, b in pair)
        total = sum(len(o) for o in outs)
        c = [run[n]["counters"] for run in rounds]
        ej = " / ".join(
            f"{x.get('ejections.shared', 0):g}, {x.get('ejected_lookups.shared', 0):g}" for x in c
        )
        pr = paired_ratios(p50[n], p50["recompute"])
        mr = paired_ratios(means[n], means["recompute"])
        lines.append(
            f"| {n} | {' / '.join(f'{p50[n][r]:.3f}' for r in range(len(rounds)))} "
            f"| {' / '.join(f'{means[n][r]:.3f}' for r in range(len(rounds)))} "
            f"| {' / '.join(f'{max(w):.2f}' for w in walls)} "
            f"| {pr.median:.2f}x ({pr.low:.2f}-{pr.high:.2f}) "
            f"| {mr.median:.2f}x ({mr.low:.2f}-{mr.high:.2f}) | {equal}/{total} "
            f"| {ej if n != 'recompute' else '-'} |"
        )
    lines += [
        "",
        "Where the time went (round 1, seconds): each contender's slowest request during the "
        "outage, and its median one.",
        "",
        "| contender | request | wall | engine steps | forward | shared lookup | Mooncake ops |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for n, which, row in _slowest_and_median(rounds[0], names):
        parts = row["parts_s"]
        ops = ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["mooncake_s"].items())) or "-"
        lines.append(
            f"| {n} | {which} | {row['wall_s']:.3f} | {parts.get('step', 0):.3f} "
            f"| {parts.get('forward', 0):.3f} "
            f"| {parts.get('lookup', 0):.3f} | {ops} |"
        )
    return "\n".join(lines) + "\n"


def _slowest_and_median(run: dict[str, Any], names: list[str]) -> list[tuple[str, str, Any]]:
    out = []
    for n in names:
        rows = sorted(run[n]["requests"], key=lambda r: r["wall_s"])
        out.append((n, "slowest", rows[-1]))
        out.append((n, "median", rows[(len(rows) - 1) // 2]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--summarize", action="store_true", help="rewrite summary.md only")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        results = json.loads((args.out / "results.json").read_text())
    else:
        model = build_tiny_model(default_cache_dir() / "tiny-llama")
        results = {"requests": args.requests, "rule": RULE, "rounds": []}
        for rnd in range(args.rounds):
            run: dict[str, Any] = {}
            for name in round_order(list(CONTENDERS), rnd):
                with tempfile.TemporaryDirectory(prefix="kvcompose-outage-") as tmp:
                    run[name] = run_contender(
                        name, model, Path(tmp), 1000 * (rnd + 1), args.warm, args.requests
                    )
                walls = [r["wall_s"] for r in run[name]["requests"]]
                shown = ", ".join(f"{w:.2f}" for w in walls)
                print(f"round {rnd + 1} {name}: {shown} s", flush=True)
            results["rounds"].append(run)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    summary = summarize(results)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
