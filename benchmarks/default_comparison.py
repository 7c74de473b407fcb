"""The default comparison of ``kvcompose bench``, results kept in ``benchmarks/results/default``.

    flock /tmp/kvcompose-engine.lock python benchmarks/default_comparison.py [kvcompose bench args]

is ``kvcompose bench --out benchmarks/results/default`` (the built-in CPU model, the chat
workload, contenders recompute / disk / multiconnector / kvcompose-first / kvcompose-longest /
kvcompose-stitch / kvcompose-fastest), followed by the goals of this benchmark
(``goals.py``). ``results.json``, ``results.csv`` and ``summary.png`` are committed; the rest
of the output directory is ignored (``benchmarks/.gitignore``).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "default"

if __name__ == "__main__":
    from kvcompose.cli.main import main

    rc = main(["bench", "--out", str(OUT), *sys.argv[1:]])
    sys.path.insert(0, str(HERE))
    import goals

    if (OUT / "results.json").is_file():
        rc = max(rc, goals.main([str(OUT / "results.json")]))
    raise SystemExit(rc)
