"""Scheduler-side overhead of composing connectors, results in ``benchmarks/results/overhead``.

    flock /tmp/kvcompose-engine.lock python benchmarks/scheduler_overhead.py [args]

is ``kvcompose bench --overhead --out benchmarks/results/overhead``: vLLM's real scheduler
drives 1,000 and 4,000 concurrent requests through no connector, one no-op connector called
directly, vLLM's MultiConnector over 2 and 4 no-op children, and a kvcompose chain over 2 and 4
(see ``kvcompose.bench.overhead``), and writes ``overhead.md``: the in-connector ratios issue 15
sets its goals in, median (range) over the rounds. About 2 minutes on 2 cores; no model runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "overhead"
#: Issue 15's goals for the in-connector time, as ratios within one run.
GOALS = (
    "Goals: kvcompose ≤ MultiConnector at 2 and 4 children; moonshot kvcompose ≤ 1.15x one "
    "child called directly at 4."
)

if __name__ == "__main__":
    from kvcompose.bench.overhead_report import markdown
    from kvcompose.bench.results import OverheadResult
    from kvcompose.cli.main import main

    code = main(["bench", "--overhead", "--out", str(OUT), *sys.argv[1:]])
    if code == 0:
        result = OverheadResult.model_validate_json((OUT / "overhead.json").read_text())
        (OUT / "overhead.md").write_text(markdown(result, GOALS))
        print((OUT / "overhead.md").read_text())
    raise SystemExit(code)
