"""``benchmarks/tier_sim.py``, the trace-level model of two store tiers: it reproduces the
engine's committed per-tier hit tokens and bytes written on the Mooncake samples
(``tier_sweep.compare``), and its admission follows the store's (a chunk's count includes
the request carrying it)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCH / "results"


pytestmark = pytest.mark.usefixtures("benchmarks_on_path")


@pytest.fixture(scope="module")
def sim(benchmarks_on_path: Path) -> ModuleType:
    return importlib.import_module("tier_sim")


@pytest.mark.parametrize(
    ("sample_dir", "as_bench"),
    [
        # run before the bench waited for the background writers before its last snapshot:
        # the last request's writes are not counted (tier_sim's ``as_bench``)
        ("mooncake_tiers", True),
        # run after it: every write counted
        ("mooncake_tiers_synthetic", False),
    ],
)
def test_reproduces_the_engine_runs(sim: ModuleType, sample_dir: str, as_bench: bool) -> None:
    """Every tier's hit tokens and bytes written, simulated, equal the engine's."""
    directory = RESULTS / sample_dir
    trace = Path(json.loads((directory / "sample.json").read_text())["trace"])
    if not trace.exists():
        pytest.skip(f"{trace} is not on this machine")
    sweep = importlib.import_module("tier_sweep")
    reqs, cap = sweep.engine_sample(directory)
    engine = json.loads((directory / "bench" / "results.json").read_text())
    checked = 0
    for contender in engine["contenders"]:
        config = sweep.config_of(contender)
        if config is None:
            continue
        simulated = sim.simulate(reqs, config, cap, as_bench=as_bench)
        stores = contender["hits"]["stores"]
        for tier in ("fast", "slow"):
            measured = stores.get(tier, {})
            assert simulated[tier]["hit_tokens"] == measured.get("tokens_loaded", 0), (
                contender["label"],
                tier,
            )
            assert simulated[tier]["bytes_written"] == measured.get("bytes_written", 0), (
                contender["label"],
                tier,
            )
        checked += 1
    assert checked >= 2


def _request(sim: ModuleType, blocks: list[int]) -> object:
    return sim.Scaled(trace_index=0, blocks=blocks, prompt_tokens=len(blocks) * 64, max_tokens=1)


def test_admission_counts_the_request_and_longest_ties_go_to_the_fast_tier(
    sim: ModuleType,
) -> None:
    """Three turns of one 512-token prompt (four chunks, three inside ``prompt[:-1]``):
    with ``admit_min_seen: 2`` the fast tier rejects the first turn, admits the second
    (which the slow tier serves) and serves the third (a tie, so the earlier tier)."""
    turn = _request(sim, list(range(1, 9)))
    cap = 8 * sim.CHUNK_FILE_BYTES
    admission = sim.Config("longest", sim.Rule(min_seen=2))
    out = sim.simulate([turn, turn, turn], admission, cap)
    assert out["slow"]["hit_tokens"] == 3 * 128
    assert out["fast"]["hit_tokens"] == 3 * 128
    assert out["fast"]["chunks_written"] == 4
    assert out["fast"]["rejects"] == 4
    every = sim.simulate([turn, turn, turn], sim.Config("longest", sim.Rule()), cap)
    assert every["fast"]["hit_tokens"] == 2 * 3 * 128
    assert every["slow"]["hit_tokens"] == 0
