"""The hybrid-model benchmarks' summaries (``benchmarks/hybrid_comparison.py``,
``benchmarks/hma_capacity.py``): from the committed runs' ``results.json`` they give the
committed ``summary.md``."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path


def _copy_runs(src: Path, dst: Path, names: list[str]) -> None:
    for name in names:
        (dst / name).mkdir(parents=True)
        shutil.copy(src / name / "results.json", dst / name / "results.json")


def test_hybrid_comparison_summary_of_the_committed_run(
    benchmarks_on_path: Path, tmp_path: Path
) -> None:
    bench = importlib.import_module("hybrid_comparison")
    run = benchmarks_on_path / "results" / "default_hybrid"
    _copy_runs(run, tmp_path, list(bench.MODELS))
    text = bench.write_summary(tmp_path)
    assert text + "\n" == (run / "summary.md").read_text()
    # every contender's row carries the blocks and HMA read from its engine
    hybrid = bench._load(run / "hybrid" / "results.json")
    assert all(c.kv_cache is not None for c in hybrid.contenders if c.ran)


def test_hma_capacity_summary_of_the_committed_run(
    benchmarks_on_path: Path, tmp_path: Path
) -> None:
    bench = importlib.import_module("hma_capacity")
    run = benchmarks_on_path / "results" / "hma_capacity"
    _copy_runs(run, tmp_path, [f"users{n}" for n in bench.LEVELS])
    text = bench.write_summary(tmp_path)
    assert text + "\n" == (run / "summary.md").read_text()
