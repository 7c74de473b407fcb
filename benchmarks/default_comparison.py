"""The default comparison of ``kvcompose bench``, results kept in ``benchmarks/results/default``.

    flock /tmp/kvcompose-engine.lock python benchmarks/default_comparison.py [kvcompose bench args]

is ``kvcompose bench --out benchmarks/results/default`` (the built-in CPU model, the chat
workload, chains recompute / disk / multiconnector / kvcompose-first / kvcompose-longest).
About 6 minutes on 2 cores. ``results.json``, ``results.csv`` and ``summary.png`` are
committed; the rest of the output directory is ignored (``benchmarks/.gitignore``).
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "default"

if __name__ == "__main__":
    from kvcompose.cli.main import main

    raise SystemExit(main(["bench", "--out", str(OUT), *sys.argv[1:]]))
