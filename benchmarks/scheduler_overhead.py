"""Scheduler-side overhead of composing connectors, results in ``benchmarks/results/overhead``.

    flock /tmp/kvcompose-engine.lock python benchmarks/scheduler_overhead.py [args]

vLLM's real scheduler drives 1,000 and 4,000 concurrent requests through no connector, one
no-op connector called directly, vLLM's MultiConnector over 2 and 4 no-op children, a
kvcompose chain over 2 and 4, a bare forwarding composite over 2 and 4, and kvcompose chains
``longest`` and ``fastest`` over 2 and 4 children that hit (see ``overhead/measure.py``), and
writes ``overhead.json`` and ``overhead.md``: the in-connector ratios issues 15 and 27 set their
goals in, median (range) over the rounds. About 2 minutes on 2
cores; no model runs. ``--help`` lists the options (``--requests 16 --repeats 1`` is a
quick check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "overhead"
#: The goals for the in-connector time and for ``fastest``, as ratios within one run.
GOALS = (
    "Goals: kvcompose ≤ MultiConnector at 2 and 4 children; moonshot kvcompose ≤ 1.15x one "
    "child called directly at 4; fastest ≤ 1.2x longest over children that hit."
)


def parser() -> argparse.ArgumentParser:
    from overhead.measure import OverheadOptions

    from kvcompose.bench.flags import add_flags

    ap = argparse.ArgumentParser(prog="scheduler_overhead.py", description=__doc__.split("\n\n")[0])
    add_flags(ap, OverheadOptions)
    ap.add_argument("--model-dir", default=None, help="default: the tiny test model")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results directory (default {OUT})")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    from overhead.measure import OverheadOptions, run_overhead
    from overhead.report import markdown, table
    from rich.console import Console

    from kvcompose.bench.flags import build

    args = parser().parse_args(argv)
    opts = build(OverheadOptions, args, model_dir=args.model_dir)
    progress = None if args.quiet else Console(stderr=True, highlight=False)
    result = run_overhead(opts, progress=progress)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_text(result.model_dump_json(indent=1) + "\n")
    (args.out / "overhead.md").write_text(markdown(result, GOALS))
    Console(width=None if sys.stdout.isatty() else 400, highlight=False).print(table(result))
    print(f"results: {args.out / 'overhead.json'}, {args.out / 'overhead.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
