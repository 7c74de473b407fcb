"""``kvcompose bench``: compare KV connector setups ("contenders") on a real vLLM engine.

With no arguments it runs the default comparison on the built-in CPU model: recompute, one
disk tier, vLLM MultiConnector over a tmpfs and a disk tier, and kvcompose over the same tiers
with ``first`` and with ``longest``, on a multi-round chat workload whose tiers hold different
prefixes. The flags come from the option dataclasses (``kvcompose.bench.flags``). The
scheduler-side cost of composing connectors is measured by ``benchmarks/scheduler_overhead.py``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

EPILOG = """\
contenders (--contender/-c, repeatable; --chain is an alias; default: the six built-ins):
  none | recompute          no connector (the reference for output agreement)
  builtin:NAME              disk, multiconnector, kvcompose-first, kvcompose-longest,
                            kvcompose-stitch
  [LABEL=]FILE.yaml|.json   a kvcompose config, or any vLLM --kv-transfer-config JSON
                            (e.g. vLLM's own MultiConnector), passed to vLLM unchanged
  In contender files, {store:NAME} / {tmpfs:NAME} become fresh per-contender directories on
  disk / in tmpfs; stores named like one of the workload's prefill sets (fast, disk) start
  with the same prepared contents for every contender.

workloads (--workload):
  chat      multi-round chat: shared system prompts (fast store), returning users'
            histories (disk store), growing histories over the measured rounds
  docqa     many questions over a few long documents (fast: document heads, disk: documents)
  noreuse   unique prompts, empty stores: the pure overhead of each contender
  FILE      JSONL, one request per line: {"id", "arrival_s", "prompt_token_ids",
            "max_tokens"}; {"prefill": STORE, "prompt_token_ids"} lines fill a store first
  mooncake:FILE  a Mooncake trace (hash_ids, input_length, timestamp): each 512-token hash
            block becomes --mooncake-block-tokens seeded token ids, sharing kept

outputs (--out): results.json, results.csv, requests.csv, ttft.png, hit_tokens.png,
summary.png, contenders/ (the built-in contender files), runs/<contender>/seed<N>/engine.log.

examples:
  kvcompose bench                                   # the default comparison
  kvcompose bench --quick                           # a 1-minute check on the tiny model
  kvcompose bench --workload docqa -c none -c my-tiers.yaml
  kvcompose bench --workload mooncake:conversation_trace.jsonl --trace-limit 40
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="compare KV connector setups on a real vLLM engine",
        description="Run one workload against several contenders (connector setups), each in "
        "a fresh vLLM engine with fresh stores, and report TTFT/TPOT/latency/"
        "throughput, per-node hits, bytes written and greedy-output agreement "
        "with recompute.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvcompose.bench.flags import add_flags, number
    from kvcompose.bench.options import BenchOptions, EngineOptions
    from kvcompose.bench.traces import MooncakeParams
    from kvcompose.bench.workloads import ChatParams, DocQAParams, NoReuseParams

    compare = parser.add_argument_group("what to compare")
    engine = parser.add_argument_group("engine")
    workload = parser.add_argument_group("workload size")
    run_group = parser.add_argument_group("run")
    groups = {"compare": compare, "engine": engine, "workload": workload, None: run_group}

    compare.add_argument(
        "--contender",
        "-c",
        "--chain",
        dest="contenders",
        action="append",
        default=[],
        metavar="SPEC",
        help="a contender to run (repeatable; see below)",
    )
    compare.add_argument(
        "--list-contenders",
        "--list-chains",
        dest="list_contenders",
        action="store_true",
        help="print the built-in contenders and exit",
    )
    compare.add_argument(
        "--quick",
        action="store_true",
        help="a small chat workload on the tiny model, one round (about a minute): "
        "checks the setup, measures nothing meaningful",
    )
    engine.add_argument(
        "--model",
        "-m",
        default=None,
        help="builtin (default: a local 8-layer Llama built on first use), tiny, "
        "builtin-hybrid or tiny-hybrid (sliding-window layers beside full attention: 2 KV "
        "cache groups), or a local model directory",
    )
    add_flags(parser, EngineOptions, groups={None: engine})
    for params in (ChatParams, DocQAParams, NoReuseParams):
        add_flags(parser, params, groups={None: workload})
    workload.add_argument(
        "--interval",
        type=number(float),
        default=None,
        help="built-in workloads: mean seconds between arrivals",
    )
    add_flags(parser, MooncakeParams, prefix="mooncake-", groups={None: workload})
    add_flags(parser, BenchOptions, groups=groups)
    run_group.add_argument("--json", action="store_true", help="print results.json to stdout too")


def options_from_args(args: argparse.Namespace) -> Any:
    from kvcompose.bench.flags import build
    from kvcompose.bench.options import BenchOptions, EngineOptions
    from kvcompose.bench.traces import MooncakeParams
    from kvcompose.bench.workloads import ChatParams, DocQAParams, NoReuseParams

    engine = build(EngineOptions, args)
    chat, doc, nr = build(ChatParams, args), build(DocQAParams, args), build(NoReuseParams, args)
    if args.interval is not None:
        chat.interval_s = doc.interval_s = nr.interval_s = args.interval
    model = args.model or "builtin"
    if args.quick:
        model = args.model or "tiny"
        chat = ChatParams(
            users=3,
            new_users=1,
            rounds=2,
            prior_rounds=1,
            system_prompts=1,
            system_len=128,
            user_len=32,
            answer_len=96,
            max_tokens=4,
            interval_s=0.3,
        )
        doc = DocQAParams(
            docs=1,
            doc_len=384,
            head_len=128,
            questions=3,
            question_len=32,
            max_tokens=4,
            interval_s=0.3,
        )
        nr = NoReuseParams(requests=4, prompt_len=256, max_tokens=4, interval_s=0.3)
        engine.max_model_len = min(engine.max_model_len, 1024)
    opts = build(
        BenchOptions,
        args,
        contenders=list(args.contenders),
        model=model,
        engine=engine,
        chat=chat,
        docqa=doc,
        noreuse=nr,
        mooncake=build(MooncakeParams, args),
    )
    opts.seeds = opts.seeds or [0]
    if args.quick:
        opts.repeats = 1
    return opts


def run(args: argparse.Namespace) -> int:
    from kvcompose.cli.common import CLIError

    con = _console(stderr=True)
    if args.list_contenders:
        from kvcompose.bench.contenders import BUILTIN_CONTENDERS

        for name, (_, description, _) in BUILTIN_CONTENDERS.items():
            print(f"{name:20s} {description}")
        return 0
    from rich.markup import escape

    from kvcompose.bench.report import tables
    from kvcompose.bench.run import BenchError, run_bench

    try:
        results = run_bench(options_from_args(args), console=con)
    except BenchError as exc:
        raise CLIError(f"kvcompose bench: {exc}") from None
    out = _console()
    for table in tables(results):
        out.print(table)
    for c in results.contenders:
        if c.status == "failed":
            out.print(
                f"[red]contender {escape(repr(c.label))} failed:[/red] {escape(c.error or '')}"
                + (f"\n  log: {escape(str(c.log))}" if c.log else "")
            )
    files = results.files
    out.print(
        f"results: {files.get('results_json')} (+ .csv, requests.csv"
        f"{', plots' if 'summary_png' in files else ''}); "
        f"{results.meta.duration_s or 0:.0f} s in all"
    )
    if results.plot_error:
        out.print(results.plot_error)
    if args.json:
        print(results.model_dump_json(indent=1))
    failed = any(c.status != "ok" for c in results.contenders)
    disagree = any(
        c.agreement and c.agreement.percent not in (None, 100.0) for c in results.contenders
    )
    return 1 if failed or disagree else 0


def _console(stderr: bool = False) -> Any:
    """A rich console; not on a terminal, one wide enough that tables are never cut."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(
        stderr=stderr, width=None if stream.isatty() else 400, highlight=False, emoji=False
    )


def main(argv: list[str] | None = None) -> int:
    """``kvcompose bench`` (also ``python -m kvcompose.cli bench``)."""
    parser = argparse.ArgumentParser(
        prog="kvcompose bench", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    from kvcompose.cli.common import CLIError

    try:
        return run(args)
    except CLIError as exc:
        print(str(exc), file=sys.stderr)
        return 1
