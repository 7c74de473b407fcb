"""``kvcompose bench``: compare connector chains on a real vLLM engine.

With no arguments it runs the default comparison on the built-in CPU model (about 10 minutes
on 2 cores): recompute, one disk tier, vLLM MultiConnector over a tmpfs and a disk tier, and
kvcompose over the same tiers with ``first`` and with ``longest``, on a multi-round chat
workload whose tiers hold different prefixes. ``--overhead`` measures the scheduler-side cost
of composing connectors instead (no model runs).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EPILOG = """\
chains (--chain, repeatable; default: the five built-in chains below):
  none | recompute          no connector (the reference for output agreement)
  builtin:NAME              disk, multiconnector, kvcompose-first, kvcompose-longest
  [LABEL=]FILE.yaml|.json   a kvcompose config, or any vLLM --kv-transfer-config JSON
                            (e.g. vLLM's own MultiConnector), passed to vLLM unchanged
  In chain files, {store:NAME} / {tmpfs:NAME} become fresh per-chain directories on disk /
  in tmpfs; stores named like one of the workload's prefill sets (fast, disk) start with
  the same prepared contents for every chain.

workloads (--workload):
  chat      multi-round chat: shared system prompts (fast store), returning users'
            histories (disk store), growing histories over the measured rounds
  docqa     many questions over a few long documents (fast: document heads, disk: documents)
  noreuse   unique prompts, empty stores: the pure overhead of each chain
  FILE      JSONL, one request per line: {"id", "arrival_s", "prompt_token_ids",
            "max_tokens"}; {"prefill": STORE, "prompt_token_ids"} lines fill a store first
  mooncake:FILE  a Mooncake trace (hash_ids, input_length, timestamp): each 512-token hash
            block becomes --mooncake-block-tokens seeded token ids, sharing kept

outputs (--out): results.json, results.csv, requests.csv, ttft.png, hit_tokens.png,
summary.png, chains/ (the built-in chain files), runs/<chain>/seed<N>/engine.log.

examples:
  kvcompose bench                                   # the default comparison
  kvcompose bench --quick                           # a 1-minute check on the tiny model
  kvcompose bench --workload docqa --chain none --chain my-tiers.yaml
  kvcompose bench --workload mooncake:conversation_trace.jsonl --trace-limit 40
  kvcompose bench --overhead                        # scheduler-side overhead, no model
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="compare connector chains on a real vLLM engine",
        description="Run one workload against several connector chains, each in a fresh "
                    "vLLM engine with fresh stores, and report TTFT/TPOT/latency/throughput, "
                    "per-node hits, bytes written and greedy-output agreement with recompute.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcompose.bench.model import EngineOptions
    from kvcompose.bench.workloads import ChatParams, DocQAParams, MooncakeParams, NoReuseParams

    chat, doc, nr, mc, eng = ChatParams(), DocQAParams(), NoReuseParams(), MooncakeParams(), \
        EngineOptions()
    g = parser.add_argument_group("what to compare")
    g.add_argument("--workload", "-w", default="chat", metavar="W",
                   help="chat (default), docqa, noreuse, a JSONL trace, or mooncake:FILE")
    g.add_argument("--chain", "-c", dest="chains", action="append", default=[],
                   metavar="SPEC", help="a chain to run (repeatable; see below)")
    g.add_argument("--list-chains", action="store_true",
                   help="print the built-in chains and exit")
    g.add_argument("--quick", action="store_true",
                   help="a small chat workload on the tiny model (about a minute): checks "
                        "the setup, measures nothing meaningful")
    g.add_argument("--overhead", action="store_true",
                   help="measure scheduler-side overhead (kvcompose vs MultiConnector vs one "
                        "child) on vLLM's real scheduler instead; no model runs")

    g = parser.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None,
                   help="builtin (default: a local 8-layer Llama built on first use), tiny, "
                        "or a local model directory")
    g.add_argument("--max-model-len", type=int, default=eng.max_model_len)
    g.add_argument("--max-num-seqs", type=int, default=eng.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=eng.max_num_batched_tokens)
    g.add_argument("--block-size", type=int, default=None,
                   help="KV cache block size (default: the platform's, 128 on CPU)")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=eng.enable_prefix_caching,
                   help="vLLM's local prefix cache (default off: every reused token then "
                        "comes from a tier)")
    g.add_argument("--dtype", default=eng.dtype)
    g.add_argument("--seeds", default="0",
                   help="comma-separated seeds; each seed builds its own workload contents "
                        "and runs every chain once (default 0)")

    g = parser.add_argument_group("workload size")
    g.add_argument("--users", type=int, default=chat.users, help="chat: users")
    g.add_argument("--new-users", type=int, default=chat.new_users,
                   help="chat: users with no history before the run")
    g.add_argument("--rounds", type=int, default=chat.rounds, help="chat: measured rounds")
    g.add_argument("--prior-rounds", type=int, default=chat.prior_rounds,
                   help="chat: rounds each returning user had before the run")
    g.add_argument("--system-prompts", type=int, default=chat.system_prompts)
    g.add_argument("--system-len", type=int, default=chat.system_len)
    g.add_argument("--user-len", type=int, default=chat.user_len)
    g.add_argument("--answer-len", type=int, default=chat.answer_len)
    g.add_argument("--docs", type=int, default=doc.docs, help="docqa: documents")
    g.add_argument("--doc-len", type=int, default=doc.doc_len)
    g.add_argument("--head-len", type=int, default=doc.head_len,
                   help="docqa: tokens of each document in the fast store")
    g.add_argument("--questions", type=int, default=doc.questions,
                   help="docqa: questions per document")
    g.add_argument("--question-len", type=int, default=doc.question_len)
    g.add_argument("--requests", type=int, default=nr.requests, help="noreuse: requests")
    g.add_argument("--prompt-len", type=int, default=nr.prompt_len, help="noreuse")
    g.add_argument("--interval", type=float, default=None,
                   help="built-in workloads: mean seconds between arrivals")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default: the workload's, 16)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival offset (0: all requests at once)")
    g.add_argument("--trace-limit", type=int, default=None,
                   help="traces: replay at most this many requests")
    g.add_argument("--mooncake-block-tokens", type=int, default=mc.block_tokens)
    g.add_argument("--mooncake-max-prompt-len", type=int, default=mc.max_prompt_len)
    g.add_argument("--mooncake-warm", type=int, default=mc.warm,
                   help="put the first N trace requests into the stores (fast: their "
                        "first blocks, disk: whole) instead of replaying them")
    g.add_argument("--mooncake-time-scale", type=float, default=mc.time_scale)

    g = parser.add_argument_group("run")
    g.add_argument("--out", "-o", default="kvcompose-bench", help="output directory")
    g.add_argument("--warmup", type=int, default=2,
                   help="warm-up requests per engine (unrelated prompts; default 2)")
    g.add_argument("--no-prefill", action="store_true",
                   help="start every store empty (ignore the workload's prepared contents)")
    g.add_argument("--keep-stores", action="store_true", help="keep store directories")
    g.add_argument("--store-dir", default=None, help="where disk stores go "
                                                      "(default: OUT/stores)")
    g.add_argument("--tmpfs-dir", default=None, help="where tmpfs stores go (default /dev/shm)")
    g.add_argument("--chain-timeout", type=float, default=1800.0,
                   help="seconds before a chain's engine is given up (default 1800)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--json", action="store_true", help="print results.json to stdout too")

    g = parser.add_argument_group("--overhead")
    g.add_argument("--overhead-requests", default="1000,4000",
                   help="concurrent requests (comma-separated; default 1000,4000)")
    g.add_argument("--overhead-children", default="2,4",
                   help="no-op children per composite (default 2,4)")
    g.add_argument("--overhead-steps", type=int, default=12,
                   help="measured scheduler steps per configuration and repeat")
    g.add_argument("--overhead-repeats", type=int, default=5,
                   help="rounds (each runs every configuration, interleaved; default 5)")


def options_from_args(args: argparse.Namespace) -> Any:
    from kvcompose.bench.core import BenchOptions
    from kvcompose.bench.model import EngineOptions
    from kvcompose.bench.workloads import ChatParams, DocQAParams, MooncakeParams, NoReuseParams

    engine = EngineOptions(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=args.prefix_caching, dtype=args.dtype,
                           block_size=args.block_size)
    chat = ChatParams(users=args.users, new_users=args.new_users, rounds=args.rounds,
                      prior_rounds=args.prior_rounds, system_prompts=args.system_prompts,
                      system_len=args.system_len, user_len=args.user_len,
                      answer_len=args.answer_len)
    doc = DocQAParams(docs=args.docs, doc_len=args.doc_len, head_len=args.head_len,
                      questions=args.questions, question_len=args.question_len)
    nr = NoReuseParams(requests=args.requests, prompt_len=args.prompt_len)
    mc = MooncakeParams(block_tokens=args.mooncake_block_tokens,
                        max_prompt_len=args.mooncake_max_prompt_len, warm=args.mooncake_warm,
                        time_scale=args.mooncake_time_scale)
    if args.interval is not None:
        chat.interval_s = doc.interval_s = nr.interval_s = args.interval
    model = args.model or "builtin"
    if args.quick:
        model = args.model or "tiny"
        chat = ChatParams(users=3, new_users=1, rounds=2, prior_rounds=1, system_prompts=1,
                          system_len=128, user_len=32, answer_len=96, max_tokens=4,
                          interval_s=0.3)
        doc = DocQAParams(docs=1, doc_len=384, head_len=128, questions=3, question_len=32,
                          max_tokens=4, interval_s=0.3)
        nr = NoReuseParams(requests=4, prompt_len=256, max_tokens=4, interval_s=0.3)
        engine.max_model_len = min(engine.max_model_len, 1024)
    try:
        seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        from kvcompose.cli.common import CLIError

        raise CLIError(f"--seeds: expected comma-separated integers, got {args.seeds!r}") from None
    return BenchOptions(
        workload=args.workload, chains=list(args.chains), model=model, engine=engine,
        seeds=seeds or [0], out_dir=args.out, chat=chat, docqa=doc, noreuse=nr, mooncake=mc,
        trace_limit=args.trace_limit, max_tokens=args.max_tokens, time_scale=args.time_scale,
        warmup_requests=args.warmup, prefill=not args.no_prefill,
        keep_stores=args.keep_stores, store_root=args.store_dir, tmpfs_root=args.tmpfs_dir,
        chain_timeout_s=args.chain_timeout, plots=not args.no_plots,
        progress=not args.no_progress)


def run(args: argparse.Namespace) -> int:
    from kvcompose.cli.common import CLIError, console

    con = console(stderr=True)
    if args.list_chains:
        from kvcompose.bench.chains import BUILTIN_CHAINS

        for name, (_, description, _) in BUILTIN_CHAINS.items():
            print(f"{name:20s} {description}")
        return 0
    if args.overhead:
        return _run_overhead(args, con)
    from kvcompose.bench.core import BenchError, run_bench
    from kvcompose.bench.report import goals_lines, slim, tables

    opts = options_from_args(args)
    try:
        results = run_bench(opts, console=con)
    except BenchError as exc:
        raise CLIError(f"kvcompose bench: {exc}") from None
    out = console()
    for table in tables(results):
        out.print(table)
    for c in results["chains"]:
        if c.get("status") == "failed":
            out.print(f"[red]chain {c['label']!r} failed:[/red] {c.get('error')}"
                      + (f"\n  log: {c['log']}" if c.get("log") else ""))
    for line in goals_lines(results):
        out.print(line)
    files = results.get("files", {})
    out.print(f"results: {files.get('results_json')} (+ .csv, requests.csv"
              f"{', plots' if 'summary_png' in files else ''}); "
              f"{results['meta']['duration_s']:.0f} s in all")
    if results.get("plot_error"):
        out.print(results["plot_error"])
    if args.json:
        import json

        print(json.dumps(slim(results), indent=1, default=str))
    failed = any(c.get("status") != "ok" for c in results["chains"])
    disagree = not results.get("goals", {}).get("output_agreement_percent", {}).get("met", True)
    return 1 if failed or disagree else 0


def _run_overhead(args: argparse.Namespace, con: Any) -> int:
    import json
    from pathlib import Path

    from kvcompose.bench.overhead import OverheadOptions, run_overhead, table

    opts = OverheadOptions(
        requests=[int(x) for x in args.overhead_requests.split(",") if x.strip()],
        children=[int(x) for x in args.overhead_children.split(",") if x.strip()],
        steps=args.overhead_steps, repeats=args.overhead_repeats)
    result = run_overhead(opts, progress=None if args.no_progress else con)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    from kvcompose.cli.common import console

    console().print(table(result))
    console().print(f"results: {out_dir / 'overhead.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvcompose.bench`` (the same as ``kvcompose bench``)."""
    parser = argparse.ArgumentParser(prog="kvcompose bench", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from kvcompose.cli.common import CLIError

    try:
        return run(args)
    except CLIError as exc:
        print(str(exc), file=sys.stderr)
        return 1
