"""``benchmarks/shared_tier_outage.py``'s summary follows from the committed run's
``results.json``, and that run shows what the docs quote: the shared leaf ejected once per
run and skipped after, every output equal to recompute's."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

#: arithmetic on a committed run: no vLLM version changes it
pytestmark = pytest.mark.version_neutral

RUN = "results/shared_tier_outage"


def test_summary_of_the_committed_run(benchmarks_on_path: Path) -> None:
    outage = importlib.import_module("shared_tier_outage")
    results = json.loads((benchmarks_on_path / RUN / "results.json").read_text())

    assert outage.summarize(results) == (benchmarks_on_path / RUN / "summary.md").read_text()
    for run in results["rounds"]:
        reference = [r["out"] for r in run["recompute"]["requests"]]
        for name in ("no-rule", "eject", "eject-async"):
            assert [r["out"] for r in run[name]["requests"]] == reference, name
        for name in ("eject", "eject-async"):
            assert run[name]["counters"]["ejections.shared"] == 1, name
            skipped = run[name]["counters"]["ejected_lookups.shared"]
            assert skipped == results["requests"] - 2, name  # after the free and the paying one
        assert "ejections.shared" not in run["no-rule"]["counters"]
