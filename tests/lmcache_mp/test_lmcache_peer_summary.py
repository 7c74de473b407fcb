"""``benchmarks/lmcache_peer.py``'s summary follows from the committed run's
``results.json`` files (one per workload), and its paired ratios are taken round by
round."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RUN = BENCHMARKS / "results" / "lmcache_peer"


@pytest.fixture
def peer():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("lmcache_peer")
    finally:
        sys.path.remove(str(BENCHMARKS))


def committed() -> dict:
    return {
        d.name: json.loads((d / "results.json").read_text())
        for d in sorted(RUN.iterdir())
        if (d / "results.json").is_file()
    }


def test_the_committed_summary_follows_from_the_committed_results(peer) -> None:
    results = committed()
    assert "chat" in results
    server = json.loads((RUN / "server.json").read_text())
    assert peer.summary(results, server) == (RUN / "summary.md").read_text()


def test_ratios_are_paired_by_round_and_a_missing_contender_is_not_measured(peer) -> None:
    run = committed()["chat"]
    by = {c["label"]: c for c in run["contenders"]}
    by["store"]["ttft_p50_rounds"] = [1.0, 2.0, 3.0]
    by["lmcache"]["ttft_p50_rounds"] = [2.0, 2.0, 2.0]
    run["contenders"] = [c for c in run["contenders"] if c["label"] != "fastest"]
    text = peer.summary({"chat": run}, {"chunk_size": 128, "l1_size_gb": 2.0})
    assert "| store / lmcache | 1.00 | 0.50-1.50 (0.50, 1.00, 1.50) |" in text
    assert "| fastest / better of store and lmcache | not measured | |" in text
