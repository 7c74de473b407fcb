"""A fleet of engines behind a round-robin router, with a shared Mooncake Store tier.

    flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/fleet_shared_tier.py

Two engines (one CPU core each, ``VLLM_CPU_OMP_THREADS_BIND``: each stands for a host of its
own) behind a router with no cache affinity: turn ``k`` of conversation ``c`` goes to engine
``(c + k) mod 2``, so every turn lands on the other engine than the turn before. The
workload is multi-turn chat in lockstep (a closed loop: every user waits for the answer,
then sends the next turn): a system prompt shared by all conversations, a first user
message, then per turn the previous turn's prompt + its greedy output + new user tokens.
Both engines serve their requests of a turn at the same time. Between turns the driver waits
until the shared store holds what the turn saved: no put in flight at the master and its key
count steady (saves are put in the background; this is the user's think time, in no TTFT).

**Two conversations by default: one request per engine at a time**, so that a request's
TTFT is its own load and prefill, not a wait behind the other request on its engine's one
core (where the engine's compute and Mooncake's transfer threads also compete).
``--conversations 4`` runs the loaded shape.
The master's lease on a read object is Mooncake's default, 10 s (``--lease-ms``); the test
bed's 1 s makes a get that takes longer fail (``LEASE_EXPIRED``) and be recomputed.

Contenders (each engine its own local tier, a ``PrefixStoreConnector`` on tmpfs, saving in
the background; the shared tier is vLLM's stock ``MooncakeStoreConnector`` over TCP):

- ``recompute``: no connector;
- ``local``: the local tier alone (a moved conversation finds only its turn before last);
- ``shared``: the shared tier alone (every turn finds the previous turn's prompt);
- ``longest``, ``stitch``, ``fastest``: a chain [local, shared] with that policy.

Each round runs every contender once, in an order rotated from round to round, each on a
fresh bed (``kvcompose.testing.mooncake.MooncakeCluster``: master, pool, two engines, empty
tiers). Per request: TTFT as the engine measures it (``kvcompose.bench.replay.measure``), the
greedy output, compared with recompute's in the same round. Per run: hit tokens per tier
(the chain's ``hit_tokens.<child>`` counters), the local tier's bytes read, and Mooncake's
own per-operation counters (``vllm:mooncake_store_operation_{keys,bytes}_total``: the bytes
that crossed the network to and from the pool). Results: ``results/fleet/results.json`` and
``summary.md`` (TTFT p50/p90 per round, ratios paired by round with ``paired_ratios``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcompose.bench.metrics import percentile
from kvcompose.bench.options import EngineOptions
from kvcompose.bench.run import round_order
from kvcompose.bench.summary import paired_ratios
from kvcompose.bench.workloads import token_block
from kvcompose.engine.model import model_facts, resolve_model
from kvcompose.testing.mooncake import MooncakeCluster, mooncake_missing
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "fleet"
CONTENDERS = ("recompute", "local", "shared", "longest", "stitch", "fastest")
COMPOSED = ("longest", "stitch", "fastest")
ENGINES = 2
MEASURE = "kvcompose.bench.replay:measure"
STORE_OPS = "kvcompose.testing.mooncake:store_operations"


@dataclass(frozen=True)
class Workload:
    """The multi-turn chat shape (token counts; ids drawn with ``token_block``)."""

    #: one conversation per engine at a time: see the module docstring
    conversations: int = 2
    turns: int = 10
    system_tokens: int = 256
    first_user_tokens: int = 384
    user_tokens: int = 192
    max_tokens: int = 32
    seed: int = 0

    def describe(self) -> str:
        return (
            f"{self.conversations} conversations x {self.turns} turns, in lockstep; turn 0 = "
            f"{self.system_tokens}-token system prompt (shared by all) + "
            f"{self.first_user_tokens} user tokens; turn k = turn k-1's prompt + its "
            f"{self.max_tokens} greedy output tokens + {self.user_tokens} new user tokens; "
            f"turn k of conversation c goes to engine (c + k) mod {ENGINES}"
        )


def first_prompt(wl: Workload, conv: int, vocab: int) -> list[int]:
    """Turn 0: the system prompt every conversation shares, then the first user message."""
    system = token_block("system", wl.system_tokens, vocab_size=vocab, seed=wl.seed)
    user = token_block(f"c{conv}t0", wl.first_user_tokens, vocab_size=vocab, seed=wl.seed)
    return system + user


def next_prompt(
    wl: Workload, conv: int, turn: int, prev: list[int], out: list[int], vocab: int
) -> list[int]:
    """Turn ``turn``'s prompt: the previous prompt, its answer, the new user message."""
    user = token_block(f"c{conv}t{turn}", wl.user_tokens, vocab_size=vocab, seed=wl.seed)
    return [*prev, *out, *user]


def engine_of(conv: int, turn: int) -> int:
    """The round-robin router: no cache affinity, a conversation moves every turn."""
    return (conv + turn) % ENGINES


def transfer_config(label: str, cluster: MooncakeCluster, local: Path) -> dict[str, Any] | None:
    """One engine's ``KVTransferConfig`` for contender ``label`` (its own local tier and its
    own ``lookup_rpc_port``)."""
    if label == "recompute":
        return None
    leaf = prefix_store_leaf("local", local, save_mode="background", medium="tmpfs")
    if label == "local":
        tree = chain("tiers", leaf)
    elif label == "shared":
        tree = chain("tiers", cluster.leaf("shared"))
    else:
        tree = chain("tiers", leaf, cluster.leaf("shared"), policy=label)
    return kvcompose_config(tree, kv_load_failure_policy="recompute")


def engine_env(i: int, bind: str) -> dict[str, str]:
    """Engine ``i``'s CPU placement: ``core``: its OpenMP threads bound to core ``i`` (vLLM's
    ``auto`` would bind every engine's threads to the same cores); ``none``: no binding, one
    OpenMP thread, the OS places it."""
    if bind == "core":
        return {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def puts_in_flight(metrics: dict[str, float]) -> float:
    """Objects the master has started a put of and not ended or revoked (its counters)."""
    m = metrics.get
    batch = (
        m("master_batch_put_start_items_total", 0)
        - m("master_batch_put_start_failed_items_total", 0)
        - m("master_batch_put_end_items_total", 0)
        - m("master_batch_put_revoke_items_total", 0)
    )
    single = (
        m("master_put_start_requests_total", 0)
        - m("master_put_start_failures_total", 0)
        - m("master_put_end_requests_total", 0)
        - m("master_put_revoke_requests_total", 0)
    )
    return batch + single


def wait_store_quiet(cluster: MooncakeCluster, timeout: float = 10.0) -> tuple[float, bool]:
    """Wait until the shared store holds what the turn saved: no put in flight at the master
    and its key count unchanged over 0.3 s (saves are put in the background, and an object
    whose put has started is listed before its data is written). Returns the seconds waited
    and whether the store went quiet before ``timeout``."""
    t0 = time.monotonic()
    last = -1.0
    while time.monotonic() - t0 < timeout:
        m = cluster.metrics()
        keys = m.get("master_key_count", 0.0)
        if keys == last and puts_in_flight(m) <= 0:
            return time.monotonic() - t0, True
        last = keys
        time.sleep(0.3)
    return time.monotonic() - t0, False


def ops_delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Mooncake's per-operation counters (``store_operations``) gained between two reads."""
    out: dict[str, dict[str, float]] = {}
    for op, v in after.items():
        b = before.get(op, {})
        d = {k: v[k] - b.get(k, 0.0) for k in v}
        if any(d.values()):
            out[op] = d
    return out


def add_into(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Add ``part``'s numbers into ``total``, nested dicts key by key."""
    for k, v in part.items():
        if isinstance(v, dict):
            add_into(total.setdefault(k, {}), v)
        elif isinstance(v, int | float):
            total[k] = total.get(k, 0) + v


def measure_turn(
    engines: list[Any],
    batches: dict[int, list[dict[str, Any]]],
    stores: dict[int, dict[str, str]],
    *,
    label: str,
    rnd: int,
) -> dict[int, Any]:
    """Every engine's batch of one turn, all engines at once (a thread each waits on its
    engine's ``measure``): engine index -> ``RunResult``."""

    def one(i: int) -> Any:
        return engines[i].call(
            MEASURE, label=label, seed=0, round_no=rnd, requests=batches[i], warmup=[],
            stores=stores[i], timeout_s=600.0, timed=False,
        )  # fmt: skip

    busy = [i for i, reqs in batches.items() if reqs]
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        futures = {i: pool.submit(one, i) for i in busy}
        return {i: f.result() for i, f in futures.items()}


def run_one(
    label: str, rnd: int, wl: Workload, model_dir: Path, vocab: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One contender, one round, on a fresh bed: every conversation's turns, both engines."""
    work = Path(tempfile.mkdtemp(prefix=f"kvcompose-fleet-r{rnd}-{label}-"))
    tiers = Path(tempfile.mkdtemp(prefix=f"kvcompose-fleet-r{rnd}-{label}-", dir=args.tmpfs))
    llm_kwargs = EngineOptions().llm_kwargs(seed=0)
    t0 = time.perf_counter()
    run: dict[str, Any] = {"label": label, "round": rnd, "requests": []}
    try:
        with MooncakeCluster(
            work,
            pool_size=args.pool_size,
            local_buffer_size=args.local_buffer_size,
            lease_ttl_ms=args.lease_ms,
        ) as cluster:
            engines = []
            for i in range(ENGINES):
                cfg = transfer_config(label, cluster, tiers / f"e{i}")
                engines.append(
                    cluster.engine(
                        f"e{i}",
                        model_dir,
                        cfg,
                        env=engine_env(i, args.bind),
                        llm_kwargs=llm_kwargs,
                        preloaded=True,
                    )
                )
            run["engine_start_s"] = round(time.perf_counter() - t0, 1)
            warm = [token_block(f"warm{i}", 256, vocab_size=vocab, seed=99) for i in range(2)]
            for e in engines:
                e.generate(warm, 4)
            stored_label = label not in ("recompute", "local")
            ops0 = [e.call(STORE_OPS) for e in engines] if stored_label else []
            prompts = {c: first_prompt(wl, c, vocab) for c in range(wl.conversations)}
            hits: dict[str, Any] = {}
            local_stats: dict[str, Any] = {}
            think = 0.0
            t_replay = time.perf_counter()
            for turn in range(wl.turns):
                batches: dict[int, list[dict[str, Any]]] = {i: [] for i in range(ENGINES)}
                for c in range(wl.conversations):
                    batches[engine_of(c, turn)].append(
                        {"id": f"c{c}t{turn}", "prompt": prompts[c], "arrival_s": 0.0,
                         "max_tokens": wl.max_tokens, "tags": {"conv": c, "turn": turn}}
                    )  # fmt: skip
                stores = {
                    i: {"local": str(tiers / f"e{i}")} if label != "shared" else {} for i in batches
                }
                results = measure_turn(engines, batches, stores, label=label, rnd=rnd)
                for i, res in results.items():
                    for node in res.connector.nodes.values():
                        if node.kind == "kvcompose":
                            add_into(hits, {k: v for k, v in node.counters.items()})
                    add_into(local_stats, res.connector.stores.get("local", {}))
                    for rec in res.requests:
                        conv, t = rec.tags["conv"], rec.tags["turn"]
                        run["requests"].append(
                            {"id": rec.id, "conv": conv, "turn": t, "engine": i,
                             "prompt_tokens": rec.prompt_tokens,
                             "ttft_s": None if rec.first_token_s is None
                             else round(rec.first_token_s - rec.arrival_s, 4),
                             "output": list(rec.output_token_ids)}
                        )  # fmt: skip
                        prompts[conv] = next_prompt(
                            wl, conv, t + 1, prompts[conv], list(rec.output_token_ids), vocab
                        )
                ttfts = [r["ttft_s"] for r in run["requests"] if r["turn"] == turn]
                print(
                    f"  r{rnd + 1} {label:9s} turn {turn}: TTFT "
                    + " ".join(f"{x * 1000:.0f}" for x in ttfts if x is not None)
                    + " ms",
                    flush=True,
                )
                if stored_label:
                    waited, quiet = wait_store_quiet(cluster)
                    think += waited
                    if not quiet:
                        run["store_not_quiet_turns"] = run.get("store_not_quiet_turns", 0) + 1
            run["replay_s"] = round(time.perf_counter() - t_replay - think, 2)
            run["think_s"] = round(think, 2)
            run["hits"] = hits
            run["local_tier"] = local_stats
            if stored_label:
                mooncake: dict[str, Any] = {}
                for e, before in zip(engines, ops0, strict=True):
                    add_into(mooncake, ops_delta(e.call(STORE_OPS), before))
                run["mooncake"] = mooncake
                run["mooncake_keys"] = len(cluster.keys())
    finally:  # the local tiers live in tmpfs: memory
        shutil.rmtree(tiers, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    run["total_s"] = round(time.perf_counter() - t0, 1)
    return run


# ----------------------------------------------------------------------------- summary


def ttft_pct(run: dict[str, Any], q: int) -> float | None:
    return percentile([r["ttft_s"] for r in run["requests"]], q)


def agreement(run: dict[str, Any], ref: dict[str, Any]) -> tuple[int, int, list[str]]:
    want = {r["id"]: r["output"] for r in ref["requests"]}
    same = [r["id"] for r in run["requests"] if want.get(r["id"]) == r["output"]]
    bad = [r["id"] for r in run["requests"] if want.get(r["id"]) != r["output"]]
    return len(same), len(run["requests"]), bad


def mooncake_bytes(run: dict[str, Any], prefix: str) -> float:
    return sum(
        v.get("bytes", 0) for op, v in run.get("mooncake", {}).items() if op.startswith(prefix)
    )


def mooncake_ms_per_call(run: dict[str, Any], op: str) -> float | None:
    """Mean milliseconds of one Mooncake operation (``load_get``, ``save_put``) in ``run``."""
    entries = [v for k, v in run.get("mooncake", {}).items() if k.startswith(op + "/")]
    calls = sum(v.get("calls", 0) for v in entries)
    return 1000 * sum(v.get("seconds", 0) for v in entries) / calls if calls else None


def aggregate(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Per contender: TTFT p50/p90 per round, ratios paired by round, agreement, mean hits."""
    by = {(r["label"], r["round"]): r for r in runs}
    out: dict[str, Any] = {}
    for label in CONTENDERS:
        mine = [by[(label, k)] for k in range(rounds) if (label, k) in by]
        if not mine:
            continue
        p50 = {r["round"]: ttft_pct(r, 50) for r in mine}
        p90 = {r["round"]: ttft_pct(r, 90) for r in mine}
        entry: dict[str, Any] = {
            "ttft_p50_rounds": [round(p50[k], 4) for k in sorted(p50)],
            "ttft_p90_rounds": [round(p90[k], 4) for k in sorted(p90)],
            "ttft_p50_median": round(statistics.median(p50.values()), 4),
        }
        for other in ("recompute", "local", "shared"):
            theirs = {r["round"]: ttft_pct(r, 50) for r in runs if r["label"] == other}
            if other != label and theirs:
                paired = paired_ratios(p50, theirs)
                entry[f"vs_{other}"] = {
                    "ratios": [round(x, 3) for x in paired.ratios],
                    "median": round(paired.median, 3),
                    "low": round(paired.low, 3),
                    "high": round(paired.high, 3),
                }
        same = total = 0
        bad: list[str] = []
        for r in mine:
            ref = by.get(("recompute", r["round"]))
            if ref is None:
                continue
            s, n, b = agreement(r, ref)
            same, total = same + s, total + n
            bad += [f"r{r['round']}/{x}" for x in b]
        entry["agreement"] = {"identical": same, "compared": total,
                              "percent": round(100 * same / total, 2) if total else None,
                              "mismatched": bad[:20]}  # fmt: skip
        n = len(mine)
        hit_keys = sorted(
            {k for r in mine for k in r.get("hits", {}) if k.startswith("hit_tokens")}
        )
        entry["hit_tokens_per_run"] = {
            k.split(".", 1)[1]: round(sum(r["hits"].get(k, 0) for r in mine) / n) for k in hit_keys
        }
        plans = sorted({k for r in mine for k in r.get("hits", {}) if k.startswith("plans.")})
        if plans:
            entry["plans_per_run"] = {
                k.split(".", 1)[1]: round(sum(r["hits"].get(k, 0) for r in mine) / n, 1)
                for k in plans
            }
        entry["local_tier_bytes_loaded_per_run"] = round(
            sum(r.get("local_tier", {}).get("bytes_loaded", 0) for r in mine) / n
        )
        entry["mooncake_load_bytes_per_run"] = round(
            sum(mooncake_bytes(r, "load") for r in mine) / n
        )
        entry["mooncake_save_bytes_per_run"] = round(
            sum(mooncake_bytes(r, "save") for r in mine) / n
        )
        for op in ("load_get", "save_put"):
            per_call = [x for r in mine if (x := mooncake_ms_per_call(r, op)) is not None]
            if per_call:
                entry[f"mooncake_{op}_ms_per_call"] = round(statistics.fmean(per_call), 1)
        local_s = sum(r.get("local_tier", {}).get("load_time_s", 0) for r in mine)
        if local_s:
            local_b = sum(r.get("local_tier", {}).get("bytes_loaded", 0) for r in mine)
            entry["local_tier_load_gbps"] = round(local_b / local_s / 1e9, 2)
        get_s = sum(
            v.get("seconds", 0)
            for r in mine
            for k, v in r.get("mooncake", {}).items()
            if k.startswith("load_get/")
        )
        if get_s:
            entry["mooncake_load_gbps"] = round(
                sum(mooncake_bytes(r, "load") for r in mine) / get_s / 1e9, 2
            )
        entry["mooncake_failed_keys_per_run"] = round(
            sum(v.get("failed_keys", 0) for r in mine for v in r.get("mooncake", {}).values()) / n,
            1,
        )
        entry["prompt_tokens_per_run"] = round(
            sum(q["prompt_tokens"] for r in mine for q in r["requests"]) / n
        )
        entry["replay_s_per_run"] = round(sum(r["replay_s"] for r in mine) / n, 1)
        out[label] = entry
    return out


def summary_md(results: dict[str, Any]) -> str:
    agg = results["contenders"]
    meta = results["meta"]
    ms = lambda xs: " / ".join(f"{x * 1000:,.0f}" for x in xs)  # noqa: E731
    lines = [
        "# Fleet: two engines behind a round-robin router, a shared Mooncake Store tier",
        "",
        f"Workload: {meta['workload_description']}.",
        f"Model: {meta['model']}; {meta['rounds']} rounds, contenders in rotated order, each "
        f"run on a fresh bed (master, pool, two engines, empty tiers); machine: "
        f"{meta['cpus']} cores, one per engine. Run took {meta['wall_s'] / 60:.1f} min.",
        "",
        *source_lines(meta),
        "TTFT is per request, measured in the engine; p50/p90 are over one round's "
        f"{meta['requests_per_run']} requests. Ratios are TTFT p50 paired by round "
        "(median, range).",
        "",
        "| contender | TTFT p50 ms by round | TTFT p90 ms by round | vs recompute | vs local "
        "| vs shared | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(e: dict[str, Any], key: str) -> str:
        r = e.get(key)
        if not r:
            return "-"
        return f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})"

    for label, e in agg.items():
        a = e["agreement"]
        agree = f"{a['percent']:.0f} % ({a['identical']}/{a['compared']})" if a["compared"] else "-"
        lines.append(
            f"| {label} | {ms(e['ttft_p50_rounds'])} | {ms(e['ttft_p90_rounds'])} | "
            f"{ratio(e, 'vs_recompute')} | {ratio(e, 'vs_local')} | {ratio(e, 'vs_shared')} | "
            f"{agree} |"
        )
    lines += [
        "",
        "Per run (mean over rounds): hit tokens by tier (the chain's `hit_tokens.<child>`), "
        "the local tier's bytes read, Mooncake's bytes over the network (engine-side "
        "`vllm:mooncake_store_operation_bytes_total`, loads and saves), its mean time a get and "
        "a put (`vllm:mooncake_store_operation_time_seconds`; puts run in the background), and "
        "each tier's load speed (bytes over the time its loads took, over all rounds).",
        "",
        "| contender | prompt tokens | hit tokens local | hit tokens shared | local MiB read "
        "| Mooncake MiB loaded | Mooncake MiB saved | Mooncake ms a get / put | failed keys "
        "| GB/s local / Mooncake loads | plans |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, e in agg.items():
        h = e["hit_tokens_per_run"]
        plans = ", ".join(f"{k} {v:g}" for k, v in e.get("plans_per_run", {}).items()) or "-"
        gbps = " / ".join(
            f"{e[k]:.2f}" if k in e else "-" for k in ("local_tier_load_gbps", "mooncake_load_gbps")
        )
        get_put = " / ".join(
            f"{e[k]:,.0f}" if k in e else "-"
            for k in ("mooncake_load_get_ms_per_call", "mooncake_save_put_ms_per_call")
        )
        lines.append(
            f"| {label} | {e['prompt_tokens_per_run']:,} | {h.get('local', 0):,} | "
            f"{h.get('shared', 0):,} | {e['local_tier_bytes_loaded_per_run'] / 2**20:,.0f} | "
            f"{e['mooncake_load_bytes_per_run'] / 2**20:,.0f} | "
            f"{e['mooncake_save_bytes_per_run'] / 2**20:,.0f} | {get_put} | "
            f"{e['mooncake_failed_keys_per_run']:g} | {gbps} | {plans} |"
        )
    lines += ["", *goal_lines(agg)]
    return "\n".join(lines) + "\n"


def source_lines(meta: dict[str, Any]) -> list[str]:
    """Which code the engines ran (recorded from the run that added ``meta["source"]`` on)."""
    src = meta.get("source")
    if not src:
        return ["Source: not recorded in this run's results.json.", ""]
    changed = src.get("uncommitted_kvcompose_files") or {}
    extra = (
        "; uncommitted library files in the working tree (git blob ids): "
        + ", ".join(f"`{f}` {h[:10]}" for f, h in changed.items())
        if changed
        else ", no uncommitted library file"
    )
    return [f"Source: commit {src['commit'][:10]}{extra}.", ""]


def goal_lines(agg: dict[str, Any]) -> list[str]:
    """The issue's goal: a composed chain beats both local-only and shared-only on TTFT p50,
    with 100 % output agreement. "Beats" here: its TTFT p50 is below the other's in every
    round (paired by round); a paired median below 1 with a round at or above 1 is reported as
    within noise, not as a win."""
    join = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    out = [
        "## Goal: a composed chain beats local-only and shared-only on TTFT p50",
        "",
        "Beats = TTFT p50 below the other's in every round (ratios paired by round); a median "
        "below 1 with some round at or above 1 is within noise.",
        "",
    ]
    met_by: list[str] = []

    def verdict(r: dict[str, Any]) -> str:
        if r["high"] < 1:
            return "beats"
        return "is within noise of" if r["low"] < 1 else "loses to"

    for label in COMPOSED:
        e = agg.get(label)
        if e is None or "vs_local" not in e or "vs_shared" not in e:
            continue
        vl, vs, a = e["vs_local"], e["vs_shared"], e["agreement"]["percent"]
        met = vl["high"] < 1 and vs["high"] < 1 and a == 100
        if met:
            met_by.append(label)
        out.append(
            f"- {label}: {verdict(vl)} local-only ({vl['median']:.2f}x, rounds "
            f"{join(vl['ratios'])}); {verdict(vs)} shared-only ({vs['median']:.2f}x, rounds "
            f"{join(vs['ratios'])}); agreement {a} %: {'met' if met else 'NOT met'}"
        )
    out += [
        "",
        f"Goal met by {', '.join(met_by)}." if met_by else "Goal NOT met by any composed chain.",
    ]
    return out


def provenance() -> dict[str, Any]:
    """The commit the engines ran, and the library files that differed from it in the working
    tree (git's blob ids of their contents then): several engineers share the tree."""
    root = HERE.parent

    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=False)
        return out.stdout

    status = git("status", "--porcelain", "--", "kvcompose").splitlines()
    changed = [ln[3:] for ln in status if ln.strip()]
    return {
        "commit": git("rev-parse", "HEAD").strip(),
        "uncommitted_kvcompose_files": {f: git("hash-object", f).strip() for f in changed},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help="comma-separated contenders (recompute always runs)")
    ap.add_argument("--conversations", type=int, default=Workload.conversations)
    ap.add_argument("--turns", type=int, default=Workload.turns)
    ap.add_argument("--system-tokens", type=int, default=Workload.system_tokens)
    ap.add_argument("--first-user-tokens", type=int, default=Workload.first_user_tokens)
    ap.add_argument("--user-tokens", type=int, default=Workload.user_tokens)
    ap.add_argument("--max-tokens", type=int, default=Workload.max_tokens)
    ap.add_argument("--model", default="builtin", help="builtin (default), tiny, or a directory")
    ap.add_argument("--pool-size", default="1 GB", help="the Mooncake pool's segment")
    ap.add_argument("--local-buffer-size", default="256 MB", help="each engine's Mooncake buffer")
    ap.add_argument("--bind", choices=("core", "none"), default="core", help="engine placement")
    ap.add_argument(
        "--lease-ms",
        type=int,
        default=10_000,
        help="the master's lease on an object read (Mooncake's default 10 s; the test bed's 1 s "
        "fails gets that take longer, LEASE_EXPIRED)",
    )
    ap.add_argument("--tmpfs", default="/dev/shm", help="where the local tiers go")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", action="store_true", help="keep the beds' logs")
    ap.add_argument(
        "--summarize", action="store_true", help="recompute the summary from results.json's runs"
    )
    args = ap.parse_args()
    if args.summarize:
        results = json.loads((args.out / "results.json").read_text())
        results["contenders"] = aggregate(results["runs"], results["meta"]["rounds"])
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        text = summary_md(results)
        (args.out / "summary.md").write_text(text)
        print(text)
        return 0
    missing = mooncake_missing()
    if missing:
        print(f"Mooncake Store cannot run here: {missing}", file=sys.stderr)
        return 2
    wl = Workload(
        args.conversations, args.turns, args.system_tokens, args.first_user_tokens,
        args.user_tokens, args.max_tokens,
    )  # fmt: skip
    labels = list(CONTENDERS)
    if args.only:
        keep = {"recompute", *args.only.split(",")}
        labels = [x for x in labels if x in keep]
    model_dir = resolve_model(args.model)
    vocab = model_facts(model_dir)["vocab_size"]
    print(f"fleet benchmark: {wl.describe()}; contenders {', '.join(labels)}", flush=True)
    source = provenance()
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for label in round_order(labels, rnd):
            run = run_one(label, rnd, wl, model_dir, vocab, args)
            runs.append(run)
            p50 = ttft_pct(run, 50) or 0.0
            hits = {k: v for k, v in run.get("hits", {}).items() if k.startswith("hit_tokens")}
            print(
                f"r{rnd + 1} {label}: TTFT p50 {p50 * 1000:.0f} ms; hits {hits}; "
                f"Mooncake loaded {mooncake_bytes(run, 'load') / 2**20:.0f} MiB "
                f"(get {mooncake_ms_per_call(run, 'load_get') or 0:.0f} ms, "
                f"put {mooncake_ms_per_call(run, 'save_put') or 0:.0f} ms a call); "
                f"start {run['engine_start_s']} s, total {run['total_s']} s "
                f"({(time.perf_counter() - t0) / 60:.1f} min)",
                flush=True,
            )
    results = {
        "meta": {
            "workload": asdict(wl),
            "workload_description": wl.describe(),
            "model": args.model,
            "model_facts": model_facts(model_dir),
            "engine": EngineOptions().llm_kwargs(seed=0),
            "rounds": args.rounds,
            "contenders": labels,
            "requests_per_run": wl.conversations * wl.turns,
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(time.perf_counter() - t0, 1),
            "pool_size": args.pool_size,
            "local_buffer_size": args.local_buffer_size,
            "lease_ms": args.lease_ms,
            "bind": args.bind,
            "source": source,
        },
        "contenders": aggregate(runs, args.rounds),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = summary_md(results)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
