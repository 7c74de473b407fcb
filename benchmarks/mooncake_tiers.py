"""The Mooncake conversation trace through a small fast tier and a larger slow tier:
recompute, the slow tier alone, the fast tier alone (unbounded), fast + slow
``first`` and ``longest``, with admission, with promotion, with both.

**Scaling to two cores.** The trace has 12,031 requests over an hour; every request starts
with the same block (hash id 0), and the rest of its reuse comes from earlier turns of the
same conversation, minutes apart, so a short time window of the trace has almost no reuse
beyond block 0 (requests 2000-2040: all reuse is of blocks first seen before the window).
This script samples whole *conversations* instead: requests are grouped by the hash ids
they share (block 0, shared by all, aside), groups of at least two requests are drawn with
a fixed seed until ``--requests`` requests are taken, and those requests are replayed in
trace order, one every ``--gap`` seconds (the trace's minutes between turns compressed).
Lengths scale by 64/512 (each 512-token trace block becomes 64 seeded token ids, prompts cut
at 2,048 tokens, prefix kept), outputs by 0.05 (1..16 tokens). The reuse ceiling is
computed for the sample itself: tokens of each prompt's leading blocks seen in an earlier
sampled prompt (an infinite cache that starts empty), rounded down to whole 128-token
chunks inside ``prompt[:-1]`` (what a store can serve).

**Tiers.** ``fast``: a PrefixStoreConnector on tmpfs with ``max_bytes`` set to a fifth of the
sample's working set (its distinct chunks); ``slow``: one on disk, unbounded. Both save in
the background (``save_mode: background``); ``longest-sync`` is plain ``longest`` with the
stores writing in the engine step, for comparison. Admission: ``admit_min_seen: 3``
(``--admit-min-seen``; the rule ``tier_sim.py``'s sweep picks, see
``results/tier_sim/README.md``; the first runs used 2).
Promotion: ``promote: true`` on the fast tier.

Run: ``flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/mooncake_tiers.py``
(about 10 minutes a round on 2 cores; ``--rounds``, default 3, each contender once a
round in rotated order; ``--only`` to run some); results (the bench's report plus
``sample.json`` and ``summary.md``) go to ``benchmarks/results/mooncake_tiers/``. The
synthetic trace: ``--trace .../synthetic_trace.jsonl --gap 2.0
--out benchmarks/results/mooncake_tiers_synthetic``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRACE = Path("/work/shared/data/mooncake-traces/conversation_trace.jsonl")
OUT = HERE / "results" / "mooncake_tiers"
BLOCK_TOKENS = 64
CHUNK_TOKENS = 128  # the bench engine's block size; one store chunk per block
MAX_PROMPT = 2048
KV_BYTES_PER_TOKEN = 32 * 1024  # the built-in bench model (8 layers, 8 KV heads of 64, fp32)


def read(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def conversations(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Groups of request indices linked by shared hash ids (ids in most requests aside)."""
    parent = list(range(len(rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    counts: dict[int, int] = {}
    for r in rows:
        for h in set(r["hash_ids"]):
            counts[h] = counts.get(h, 0) + 1
    common = {h for h, n in counts.items() if n > len(rows) // 2}
    owner: dict[int, int] = {}
    for i, r in enumerate(rows):
        for h in r["hash_ids"]:
            if h in common:
                continue
            j = owner.setdefault(h, i)
            if j != i:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


def sample(rows: list[dict[str, Any]], n: int, seed: int) -> list[int]:
    groups = [g for g in conversations(rows) if len(g) >= 2]
    rng = random.Random(seed)
    rng.shuffle(groups)
    chosen: list[int] = []
    for g in groups:
        if len(chosen) >= n:
            break
        if len(g) > n // 3:  # keep the sample from being one long conversation
            continue
        chosen.extend(g)
    return sorted(chosen[: max(n, 0)] if len(chosen) <= n else chosen)


def token_block(h: int, seed: int) -> list[int]:
    from kvcompose.bench.workloads import token_block as tb

    return tb(f"mc{h}", BLOCK_TOKENS, vocab_size=1024, seed=seed)


class Scaled(NamedTuple):
    """One sampled trace request at the bench's scale."""

    trace_index: int
    #: The trace's hash ids of the blocks the scaled prompt covers (64 tokens each).
    blocks: list[int]
    prompt_tokens: int
    max_tokens: int


def scale(rows: list[dict[str, Any]], picked: list[int]) -> list[Scaled]:
    """The picked requests in trace order, lengths scaled (see the module docstring)."""
    out = []
    for i in picked:
        r = rows[i]
        hash_ids = [int(h) for h in r["hash_ids"]]
        n = max(1, round(int(r["input_length"]) * BLOCK_TOKENS / 512))
        n = min(n, MAX_PROMPT, len(hash_ids) * BLOCK_TOKENS)
        used = hash_ids[: (n + BLOCK_TOKENS - 1) // BLOCK_TOKENS]
        tokens = max(1, min(round(int(r.get("output_length", 1)) * 0.05), 16))
        out.append(Scaled(i, used, n, tokens))
    return out


def chunk_prefixes(req: Scaled) -> list[tuple[int, ...]]:
    """Each of the request's whole store chunks, named by the trace blocks up to its end (two
    requests share a chunk exactly when they share these)."""
    per_chunk = CHUNK_TOKENS // BLOCK_TOKENS
    n_chunks = req.prompt_tokens // CHUNK_TOKENS
    return [tuple(req.blocks[: (c + 1) * per_chunk]) for c in range(n_chunks)]


def ceiling_tokens(reqs: list[Scaled]) -> int:
    """Hit tokens of an infinite cache that starts empty: each prompt's leading blocks seen in
    an earlier request, rounded down to whole chunks inside ``prompt[:-1]``."""
    seen: set[int] = set()
    total = 0
    for req in reqs:
        lead = 0
        for h in req.blocks:
            if h not in seen:
                break
            lead += 1
        total += min(lead * BLOCK_TOKENS, req.prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS
        seen.update(req.blocks)
    return total


def working_set_chunks(reqs: list[Scaled]) -> int:
    """How many distinct chunks the requests have."""
    return len({c for req in reqs for c in chunk_prefixes(req)})


def working_set_bytes(reqs: list[Scaled]) -> int:
    """The KV bytes of the requests' distinct chunks."""
    return working_set_chunks(reqs) * CHUNK_TOKENS * KV_BYTES_PER_TOKEN


def build(args: argparse.Namespace) -> dict[str, Any]:
    rows = read(args.trace)
    picked = sample(rows, args.requests, args.seed)
    reqs = scale(rows, picked)
    lines: list[dict[str, Any]] = []
    seen: set[int] = set()
    prompt_tokens = blocks = reused_blocks = 0
    for rank, req in enumerate(reqs):
        used, n = req.blocks, req.prompt_tokens
        blocks += len(used)
        reused_blocks += sum(1 for h in used if h in seen)
        seen.update(used)
        prompt = [t for h in used for t in token_block(h, args.seed)][:n]
        prompt_tokens += n
        lines.append(
            {
                "id": f"mc{req.trace_index}",
                "arrival_s": round(rank * args.gap, 3),
                "prompt_token_ids": prompt,
                "max_tokens": req.max_tokens,
                "trace_index": req.trace_index,
            }
        )
    ceiling_tokens_ = ceiling_tokens(reqs)
    chunks = working_set_chunks(reqs)
    working_set = chunks * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
    info = {
        "trace": str(args.trace),
        "seed": args.seed,
        "requests": len(lines),
        "trace_indices": picked,
        "gap_s": args.gap,
        "prompt_tokens": prompt_tokens,
        "blocks": blocks,
        "block_reuse_percent": round(100 * reused_blocks / max(blocks, 1), 1),
        "ceiling_hit_tokens": ceiling_tokens_,
        "ceiling_percent_of_prompt_tokens": round(100 * ceiling_tokens_ / max(prompt_tokens, 1), 1),
        "working_set_chunks": chunks,
        "working_set_bytes": working_set,
        "fast_max_bytes": working_set // 5,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "trace.jsonl", "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line) + "\n")
    (args.out / "sample.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def leaf(name: str, path: str, **extra: Any) -> str:
    body = ", ".join([f'path: "{path}"', *(f"{k}: {json.dumps(v)}" for k, v in extra.items())])
    return (
        f"      - leaf:\n          name: {name}\n          connector: PrefixStoreConnector\n"
        f"          module_path: kvcompose.stores\n          extra_config: {{{body}}}\n"
    )


def chain(policy: str, fast: dict[str, Any], slow: dict[str, Any]) -> str:
    return (
        "version: 1\nkv_role: kv_both\ntree:\n  chain:\n    name: tiers\n"
        f"    policy: {policy}\n    children:\n"
        + leaf("fast", "{tmpfs:fast}", **fast)
        + leaf("slow", "{store:slow}", **slow)
    )


def contenders(info: dict[str, Any], out: Path, admit_min_seen: int = 3) -> list[str]:
    cap = info["fast_max_bytes"]
    bg = {"save_mode": "background"}
    fast = {"medium": "tmpfs", "max_bytes": cap, **bg}
    slow = {"medium": "disk", **bg}
    files = {
        "slow": "version: 1\nkv_role: kv_both\ntree:\n  chain:\n    name: tiers\n"
        "    children:\n" + leaf("slow", "{store:slow}", **slow),
        # The fast tier alone and unbounded: with "slow", which tier serves a hit, alone.
        "fast-only": "version: 1\nkv_role: kv_both\ntree:\n  chain:\n    name: tiers\n"
        "    children:\n" + leaf("fast", "{tmpfs:fast}", medium="tmpfs", **bg),
        "first": chain("first", fast, slow),
        "longest": chain("longest", fast, slow),
        "longest-sync": chain("longest", {"medium": "tmpfs", "max_bytes": cap}, {"medium": "disk"}),
        "admission": chain("longest", {**fast, "admit_min_seen": admit_min_seen}, slow),
        "promotion": chain("longest", {**fast, "promote": True}, slow),
        "both": chain("longest", {**fast, "admit_min_seen": admit_min_seen, "promote": True}, slow),
    }
    cdir = out / "contenders"
    cdir.mkdir(parents=True, exist_ok=True)
    specs = ["recompute=none"]
    for label, text in files.items():
        path = cdir / f"{label}.yaml"
        path.write_text(text)
        specs.append(f"{label}={path}")
    return specs


def summarize(out: Path) -> str:
    """The per-configuration table from the bench's ``results.json`` and ``sample.json``:
    TTFT p50 as the median of the rounds' p50s with their range, the ratio to recompute as
    the median of the per-round ratios with their range, p90 over every round's requests,
    hit tokens and bytes per replay (the mean over rounds)."""
    info = json.loads((out / "sample.json").read_text())
    results = json.loads((out / "bench" / "results.json").read_text())
    ceiling = info["ceiling_hit_tokens"]
    rounds = results["meta"].get("repeats", 1)
    rows = [
        f"Sample: {info['requests']} requests, {info['prompt_tokens']:,} prompt tokens, "
        f"one every {info['gap_s']} s; reuse ceiling {ceiling:,} hit tokens "
        f"({info['ceiling_percent_of_prompt_tokens']} % of prompt tokens; "
        f"{info['block_reuse_percent']} % of trace blocks); working set "
        f"{info['working_set_bytes'] / 2**20:.0f} MiB, fast tier capped at "
        f"{info['fast_max_bytes'] / 2**20:.0f} MiB; {rounds} round(s).",
        "",
        "| configuration | TTFT p50 ms (rounds) | p90 ms | vs recompute (range) "
        "| hit tokens fast | slow | % of ceiling | MiB written fast | slow | agree % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["contenders"]:
        lat = c["latency"]
        stores = (c.get("hits") or {}).get("stores") or {}
        fast = stores.get("fast", {})
        slow = stores.get("slow", {})
        hit = sum(s.get("tokens_loaded", 0) for s in stores.values())
        agree = (c.get("agreement") or {}).get("percent")
        p50s = c.get("ttft_p50_rounds") or [lat["ttft_p50_s"]]
        p50 = f"{statistics.median(p50s) * 1e3:,.0f}"
        if len(p50s) > 1:
            p50 += " (" + ", ".join(f"{v * 1e3:,.0f}" for v in p50s) + ")"
        ratio = f"{c.get('ttft_p50_speedup') or 1.0:.1f}x"
        if c.get("speedup_low") is not None and len(c.get("speedup_rounds") or []) > 1:
            ratio += f" ({c['speedup_low']:.1f}-{c['speedup_high']:.1f})"
        rows.append(
            f"| {c['label']} | {p50} | {lat['ttft_p90_s'] * 1e3:,.0f} | {ratio} "
            f"| {fast.get('tokens_loaded', 0):,} | {slow.get('tokens_loaded', 0):,} "
            f"| {100 * hit / ceiling:.0f} % "
            f"| {fast.get('bytes_written', 0) / 2**20:,.0f} "
            f"| {slow.get('bytes_written', 0) / 2**20:,.0f} | {agree} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gap", type=float, default=1.5, help="seconds between arrivals")
    ap.add_argument(
        "--admit-min-seen",
        type=int,
        default=3,
        help="the fast tier's admit_min_seen in admission/both (default 3: tier_sim.py's "
        "sweep; the first single-round runs used 2)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="bench rounds (--repeats), order rotated")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--only", help="comma-separated configurations to run (recompute kept)")
    ap.add_argument("--summarize", action="store_true", help="only print the summary table")
    ap.add_argument("bench_args", nargs="*", help="extra kvcompose bench arguments")
    args = ap.parse_args()
    if args.summarize:
        table = summarize(args.out)
        (args.out / "summary.md").write_text(table + "\n")
        print(table)
        return
    info = build(args)
    print(json.dumps({k: v for k, v in info.items() if k != "trace_indices"}, indent=2))
    specs = contenders(info, args.out, args.admit_min_seen)
    if args.only:
        keep = {"recompute", *args.only.split(",")}
        specs = [spec for spec in specs if spec.split("=", 1)[0] in keep]
    if args.build_only:
        return
    cmd = [
        sys.executable,
        "-m",
        "kvcompose.cli",
        "bench",
        "--workload",
        str(args.out / "trace.jsonl"),
    ]
    for spec in specs:
        cmd += ["-c", spec]
    cmd += ["--out", str(args.out / "bench"), "--repeats", str(args.rounds), *args.bench_args]
    print(" ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 0:
        table = summarize(args.out)
        (args.out / "summary.md").write_text(table + "\n")
        print(table)
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
