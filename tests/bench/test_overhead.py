"""The scheduler-overhead benchmark (``benchmarks/scheduler_overhead.py`` and its package
``benchmarks/overhead``) runs on vLLM's real scheduler (no model); no timing checks."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def benchmarks_importable() -> Iterator[None]:
    """``benchmarks/`` on ``sys.path``, as when its scripts run: the benchmark imports as
    ``overhead``, and vLLM imports ``FloorConnector`` by its module path ``overhead.floor``."""
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def test_overhead_benchmark_runs_every_configuration(tiny_model: Path) -> None:
    from overhead.measure import OverheadOptions, run_overhead
    from overhead.report import markdown, table

    result = run_overhead(
        OverheadOptions(requests=[16], children=[2], steps=2, repeats=1, model_dir=str(tiny_model))
    )
    entry = json.loads(result.model_dump_json())["by_requests"]["16"]  # overhead.json's form
    assert set(entry["configs"]) == {
        "none",
        "direct",
        "multiconnector-2",
        "kvcompose-2",
        "floor-2",
    }
    calls = {name: row["connector_calls"] for name, row in entry["configs"].items()}
    assert calls["none"] == 0
    # The scheduler makes the same calls into its connector whatever it is.
    assert calls["direct"] == calls["multiconnector-2"] == calls["kvcompose-2"] > 0
    assert calls["floor-2"] == calls["direct"]
    for name in ("direct", "multiconnector-2", "kvcompose-2", "floor-2"):
        by_method = entry["configs"][name]["in_connector_us_per_request_by_method"]
        assert {
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "request_finished",
            "build_connector_meta",
        } <= set(by_method)
    assert set(entry["ratios"]["2_children"]) >= {
        "kvcompose_over_multiconnector",
        "kvcompose_over_direct",
        "kvcompose_over_floor",
        "floor_over_direct",
    }
    assert entry["ratios"]["2_children"]["kvcompose_over_floor"] > 0
    assert table(result).row_count == 6
    ratios = entry["ratios"]["2_children"]
    assert len(ratios["kvcompose_over_multiconnector_rounds"]) == 1  # one per round
    assert (
        ratios["kvcompose_over_multiconnector"] == ratios["kvcompose_over_multiconnector_rounds"][0]
    )
    md = markdown(result)
    row = next(line for line in md.splitlines() if line.startswith("| 16 | 2 |"))
    assert f"{ratios['kvcompose_over_multiconnector']:.2f}" in row
    assert f"{ratios['kvcompose_over_floor']:.2f}" in row


def test_noop_connector_is_a_complete_connector() -> None:
    from overhead.floor import FloorConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.testing.noop import NoopConnector

    for cls in (NoopConnector, FloorConnector):
        assert issubclass(cls, KVConnectorBase_V1)
        assert not getattr(cls, "__abstractmethods__", set())


def test_committed_overhead_results_read_back() -> None:
    """``overhead.json`` keeps its form: the committed results validate as ``OverheadResult``."""
    from overhead.results import OverheadResult

    path = BENCH / "results/overhead/overhead.json"
    result = OverheadResult.model_validate_json(path.read_text())
    assert set(result.by_requests) == {"1000", "4000"}
    assert result.by_requests["1000"].ratios["2_children"].kvcompose_over_multiconnector


def test_the_script_takes_the_options_as_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``OverheadOptions`` field is a flag of the script, checked as it is parsed."""
    from overhead.measure import OverheadOptions
    from scheduler_overhead import parser

    from kvcompose.bench.flags import build

    assert build(OverheadOptions, parser().parse_args([])) == OverheadOptions()
    opts = build(OverheadOptions, parser().parse_args(["--requests", "16,32", "--repeats", "2"]))
    assert opts.requests == [16, 32] and opts.repeats == 2
    with pytest.raises(SystemExit):
        parser().parse_args(["--children", "0"])
    assert "--children: expected comma-separated" in capsys.readouterr().err
