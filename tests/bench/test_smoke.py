"""Smoke test: ``kvcompose bench`` end to end on the tiny model, two contenders, tiny workload.

Starts real vLLM engines (one per store to prepare, one per contender and round), so it is
marked ``engine``. No timing assertions: it checks that every output exists, that the
kvcompose contender really loaded KV from its tiers, that its greedy outputs equal the
recompute run's in every round, that rounds rotate the order, and what a run that is not on a
terminal prints.
"""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

TINY_CHAT = shlex.split(
    "--workload chat --users 2 --new-users 1 --rounds 1 --prior-rounds 1 --system-prompts 1 "
    "--system-len 128 --user-len 32 --answer-len 96 --max-tokens 4 --interval 0.2 --warmup 1 "
    "--max-model-len 1024 --contender-timeout 400"
)


def test_bench_two_contenders_end_to_end(tmp_path: Path, tiny_model: Path, capsys) -> None:
    from kvcompose.cli.main import main

    out = tmp_path / "bench"
    args = ["--contender", "none", "-c", "tiers=builtin:kvcompose-longest", "--repeats", "2"]
    rc = main(["bench", "--model", str(tiny_model), *TINY_CHAT, *args, "--out", str(out),
               "--tmpfs-dir", str(tmp_path / "tmpfs")])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr()

    for name in ("results.json", "results.csv", "requests.csv", "ttft.png", "hit_tokens.png",
                 "summary.png", "workload.jsonl"):  # fmt: skip
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["repeats"] == 2
    contenders = {c["label"]: c for c in results["contenders"]}
    assert set(contenders) == {"recompute", "tiers"}
    assert all(c["status"] == "ok" for c in contenders.values())
    tiers = contenders["tiers"]
    assert tiers["agreement"]["compared"] == 4  # 2 requests in each of 2 rounds
    assert tiers["agreement"]["percent"] == 100.0
    assert tiers["agreement"]["reference"] == "recompute"
    # One ratio to recompute per round, their median and range; the noise comparison.
    assert len(tiers["speedup_rounds"]) == 2
    assert tiers["speedup_low"] <= tiers["ttft_p50_speedup"] <= tiers["speedup_high"]
    assert isinstance(tiers["within_noise_of"], list)
    # The tiers were used: the returning user's history came from the disk tier, the new
    # user's system prompt from the fast tier (each 128-token block is one chunk); hits are
    # per replay of the workload (the same in both rounds).
    stores = tiers["hits"]["stores"]
    assert stores["disk"]["tokens_loaded"] == 256
    assert stores["fast"]["tokens_loaded"] == 128
    node = tiers["hits"]["nodes"]["tiers"]
    assert node["lookups"] == 2
    assert node["children"]["disk"]["hit_tokens"] == 256
    assert contenders["recompute"]["hits"]["tokens_loaded"] == 0
    # Each row's KV cache, read from its engine: the tiny model has one group; the tree
    # (hma: auto, every leaf supports HMA) keeps vLLM's hybrid KV cache manager on.
    for c in contenders.values():
        assert c["kv_cache"]["num_blocks"] > 0 and c["kv_cache"]["hma"] is True, c["label"]
        assert c["kv_cache"]["groups"] == ["FullAttentionSpec"] and c["preemptions"] == 0
        assert c["peak_running"] >= 1

    with open(out / "requests.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8 and {r["contender"] for r in rows} == {"recompute", "tiers"}
    assert {r["round"] for r in rows} == {"0", "1"}
    assert all(float(r["ttft_s"]) >= 0 for r in rows)
    # Not on a terminal: one line per contender and round, the order rotating.
    runs = [line.split(":")[0] for line in printed.err.splitlines() if "requests, TTFT" in line]
    assert runs == ["recompute, round 1/2", "tiers, round 1/2", "tiers, round 2/2",
                    "recompute, round 2/2"]  # fmt: skip
    # ...and the tables are not cut to a terminal's width.
    assert "within noise of" in printed.out
    assert all(not line.endswith("…") for line in printed.out.splitlines())
    # Stores are cleaned up unless --keep-stores.
    assert not (out / "stores").exists()
    assert not any((tmp_path / "tmpfs").iterdir())


def test_bench_reports_a_contender_that_fails_and_runs_the_others(
    tmp_path: Path, tiny_model: Path
) -> None:
    from kvcompose.cli.main import main

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}))
    out = tmp_path / "bench"
    args = shlex.split(
        "--workload noreuse --requests 2 --prompt-len 64 --max-tokens 2 --interval 0 "
        "--warmup 0 --no-progress --no-plots --max-model-len 512 --chain-timeout 300 "
        "--repeats 1"
    )
    # --chain is the older name of --contender
    rc = main(["bench", "--model", str(tiny_model), *args, "--chain", "none",
               "--chain", str(broken), "--out", str(out)])  # fmt: skip
    assert rc == 1  # a contender failed
    results = json.loads((out / "results.json").read_text())
    contenders = {c["label"]: c for c in results["contenders"]}
    assert contenders["recompute"]["status"] == "ok"
    assert contenders["recompute"]["latency"]["finished"] == 2
    broken = contenders["broken"]
    assert broken["status"] == "failed"
    assert "NoSuchConnector" in broken["error"]
    assert "NoSuchConnector" in Path(broken["log"]).read_text()
