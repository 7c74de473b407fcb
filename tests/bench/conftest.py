"""The benchmark scripts' tests: ``benchmarks/`` on ``sys.path``, as when the scripts run
(they import each other, e.g. ``fastest_mixed`` imports ``fastest_slow_tier``, and vLLM
imports the overhead benchmark's ``FloorConnector`` by its module path ``overhead.floor``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmarks_on_path() -> Iterator[Path]:
    sys.path.insert(0, str(BENCH))
    try:
        yield BENCH
    finally:
        sys.path.remove(str(BENCH))
