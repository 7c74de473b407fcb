"""The scheduler-overhead benchmark (``benchmarks/scheduler_overhead.py`` and its package
``benchmarks/overhead``) runs on vLLM's real scheduler (no model); no timing checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


pytestmark = pytest.mark.usefixtures("benchmarks_on_path")  # imported as ``overhead``


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
        "longest-2",
        "fastest-2",
    }
    calls = {name: row["connector_calls"] for name, row in entry["configs"].items()}
    assert calls["none"] == 0
    # The scheduler makes the same calls into its connector whatever it is.
    assert calls["direct"] == calls["multiconnector-2"] == calls["kvcompose-2"] > 0
    assert calls["floor-2"] == calls["direct"]
    # with a connector hit the scheduler also asks ``get_external_cache_hit_sources``, once a
    # request (``Scheduler.schedule``)
    assert calls["longest-2"] == calls["fastest-2"] == calls["direct"] + 16
    computed = {name: row["computed_tokens_per_request"] for name, row in entry["configs"].items()}
    # the no-op children miss; longest's and fastest's hit, both loading child 0's (the prompt
    # less a block: 96 - 80 tokens left to compute)
    assert computed["direct"] == computed["kvcompose-2"] == computed["floor-2"] == 96
    assert computed["longest-2"] == computed["fastest-2"] == 16
    for name in ("direct", "multiconnector-2", "kvcompose-2", "floor-2", "fastest-2"):
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
        "fastest_over_longest",
    }
    assert entry["ratios"]["2_children"]["kvcompose_over_floor"] > 0
    assert entry["ratios"]["2_children"]["fastest_over_longest"] > 0
    assert table(result).row_count == 8
    ratios = entry["ratios"]["2_children"]
    assert len(ratios["kvcompose_over_multiconnector_rounds"]) == 1  # one per round
    assert (
        ratios["kvcompose_over_multiconnector"] == ratios["kvcompose_over_multiconnector_rounds"][0]
    )
    md = markdown(result)
    row = next(line for line in md.splitlines() if line.startswith("| 16 | 2 |"))
    assert f"{ratios['kvcompose_over_multiconnector']:.2f}" in row
    assert f"{ratios['kvcompose_over_floor']:.2f}" in row
    assert row.split("|")[-2].strip().startswith(f"{ratios['fastest_over_longest']:.2f} (")


def test_fastest_chain_weighs_every_plan_for_every_request(tiny_model: Path) -> None:
    """``fastest-k``'s children have a prior, so no request skips the plan choice (a cold
    child takes one load at a time, ``Costs.usable``) and every one loads child 0's hit."""
    from overhead.measure import configurations

    from kvcompose.engine.harness import SchedulerHarness

    ktc = configurations([3], prompt_len=80, block_size=16)["fastest-3"]
    with SchedulerHarness(tiny_model, ktc, block_size=16, num_blocks=64) as h:
        for _ in range(4):
            h.add_request(num_tokens=80, max_tokens=2)
        first = h.step()
        assert first.scheduled == {f"req-{i}": 80 - 64 for i in range(4)}
        h.run_until_idle()
        h.assert_clean()
        assert h.connector.stats_totals()["counters"]["plans.load"] == 4  # type: ignore[union-attr]


def test_configurations_refuse_a_prompt_too_short_for_the_children() -> None:
    from overhead.measure import configurations

    with pytest.raises(ValueError, match="leaves child 3 of 4 no block"):
        configurations([4], prompt_len=64, block_size=16)


def test_noop_connector_is_a_complete_connector() -> None:
    from overhead.floor import FloorConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcompose.testing.noop import NoopConnector

    for cls in (NoopConnector, FloorConnector):
        assert issubclass(cls, KVConnectorBase_V1)
        assert not getattr(cls, "__abstractmethods__", set())


def test_noop_connector_hits_only_when_told_to(harness_factory: Any) -> None:
    """``hit_tokens``: a sync hit of the prompt's first tokens, cut to a block and to all but
    the last token, less what is computed; the scheduler counts them computed and the requests
    finish with every block back. Without it every lookup misses, as always."""
    from kvcompose.testing.noop import NoopConnector, noop_config

    def lookups(hit_tokens: int) -> list[tuple[int | None, bool]]:
        h = harness_factory(noop_config(hit_tokens=hit_tokens), block_size=16, num_blocks=64)
        conn = h.connector
        assert isinstance(conn, NoopConnector)
        long, short = h.add_request(num_tokens=80), h.add_request(num_tokens=20)
        answers = [
            conn.get_num_new_matched_tokens(long, 0),
            conn.get_num_new_matched_tokens(long, 16),
            conn.get_num_new_matched_tokens(long, 48),
            conn.get_num_new_matched_tokens(short, 0),
        ]
        first = h.step()
        computed = 80 - answers[0][0], 20 - answers[3][0]  # type: ignore[operator]
        assert first.scheduled == {long.request_id: computed[0], short.request_id: computed[1]}
        h.run_until_idle()
        assert set(h.finished) == {long.request_id, short.request_id}
        h.assert_clean()
        return answers

    # 40 tokens held: 32 on a block; a 20-token prompt leaves one token: 19, cut to 16
    assert lookups(40) == [(32, False), (16, False), (0, False), (16, False)]
    assert lookups(200) == [(64, False), (48, False), (16, False), (16, False)]
    assert lookups(0) == [(0, False)] * 4
    assert noop_config() == noop_config(hit_tokens=0)  # the default config is unchanged


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
