"""The CPU-checkable parts of ``scripts/gpu-check.sh`` (``scripts/gpu_check.py``):
arguments, the P and D configs, the engine commands, the workload, reading the metrics.
The GPU run itself has not been made (no GPU on these machines)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvcompose.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path) -> ModuleType:
    """Import a script of ``scripts/`` (not a package) by its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _script(ROOT / "scripts" / "gpu_check.py")


def test_defaults_fit_two_engines_and_the_tiny_model() -> None:
    opts = gpu_check.parse_args([])
    assert 2 * opts.gpu_memory_utilization < 0.9
    assert opts.prefix_tokens + opts.suffix_tokens + opts.max_tokens <= opts.max_model_len
    assert len(set(opts.ports.values())) == len(opts.ports)


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpu-memory-utilization", "0.6"],
        ["--requests", "0"],
        ["--prefix-tokens", "1000", "--max-model-len", "1024"],
        ["--lmcache-adapter", "other"],
        ["--offload-cpu-gb", "0"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(argv)
    assert exc.value.code == 2


def test_decode_is_nixl_then_lmcache_and_kvcompose_accepts_both_configs() -> None:
    opts = gpu_check.parse_args([])
    decode = load_config(gpu_check.decode_document(opts), env={}, check_vllm=False)
    chain = decode.tree
    assert [c.name for c in chain.children] == ["nixl", "lmcache"]
    assert chain.policy == "first"
    lmcache = chain.children[1]
    assert lmcache.connector == "LMCacheConnectorV1"
    assert lmcache.transfer_fields()["kv_role"] == "kv_both"  # saves on a kv_consumer D
    assert lmcache.extra_config == {"use_native": True}
    assert decode.warnings == ()
    prefill = load_config(gpu_check.prefill_document(), env={}, check_vllm=False)
    assert [c.connector for c in prefill.tree.children] == ["NixlConnector"]
    own = gpu_check.decode_document(gpu_check.parse_args(["--lmcache-adapter", "lmcache"]))
    assert "extra_config" not in own["tree"]["chain"]["children"][1]["leaf"]


def test_engine_commands() -> None:
    opts = gpu_check.parse_args(["--base-port", "9000", "--chunk-size", "128"])
    plan = gpu_check.engines(opts, "/models/m")
    assert set(plan) == {"baseline", "prefill", "decode"}
    assert len({e.port for e in plan.values()}) == 3
    assert "--kv-transfer-config" not in plan["baseline"].argv
    for name in ("prefill", "decode"):
        argv = plan[name].argv
        assert argv[argv.index("--port") + 1] == str(plan[name].port)
        assert "--no-enable-prefix-caching" in argv
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector"] == "KVCompose"
        assert load_config(ktc, env={}, check_vllm=False).tree.children[0].name == "nixl"
    sides = {plan[n].env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for n in ("prefill", "decode")}
    assert len(sides) == 2, "each engine serves its own NIXL side channel"
    assert plan["decode"].env["LMCACHE_CHUNK_SIZE"] == "128"
    assert plan["decode"].env["LMCACHE_LOCAL_CPU"] == "True"
    assert not any(k.startswith("LMCACHE_") for k in plan["prefill"].env)


def test_the_hybrid_phase_runs_the_offloading_connector_under_kvcompose_hma() -> None:
    opts = gpu_check.parse_args(["--base-port", "9000", "--offload-cpu-gb", "2"])
    plan = gpu_check.engines(opts, "/models/m", "/models/h")
    assert list(plan) == ["baseline", "prefill", "decode", "hybrid-baseline", "hybrid-offload"]
    assert len({e.port for e in plan.values()}) == 5
    for name in ("hybrid-baseline", "hybrid-offload"):
        argv = plan[name].argv
        assert argv[argv.index("--model") + 1] == "/models/h"
        assert argv[argv.index("--port") + 1] == str(plan[name].port)
        assert "--no-enable-prefix-caching" in argv  # round 2 must load from the CPU tier
    assert "--kv-transfer-config" not in plan["hybrid-baseline"].argv
    argv = plan["hybrid-offload"].argv
    ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    # hma: true: the entry that keeps vLLM's hybrid KV cache manager on
    assert ktc["kv_connector"] == "KVComposeHMA"
    from kvcompose.config import vllm_available

    config = load_config(ktc, env={}, check_vllm=vllm_available())
    (leaf,) = config.tree.children
    assert leaf.name == "cpu" and leaf.connector == "OffloadingConnector"
    assert leaf.extra_config == {"cpu_bytes_to_use": 2 * 2**30}
    assert set(gpu_check.engines(opts, "/models/m")) == {"baseline", "prefill", "decode"}


def test_workload_is_prefix_heavy() -> None:
    opts = gpu_check.parse_args(["--requests", "5", "--prefix-tokens", "100"])
    work = gpu_check.prompts(opts)
    assert len(work) == 5 and len({tuple(p) for p in work}) == 5
    assert all(p[:100] == work[0][:100] for p in work)
    assert all(4 <= t < 1000 for p in work for t in p)
    body = gpu_check.completion(work[0], 1, {"do_remote_decode": True})
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True


def test_metrics_are_read_as_vllm_exports_them() -> None:
    """The counter kvcompose registers (``composite/stats.py``), written by
    prometheus_client as vLLM's /metrics does, read back per child."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from kvcompose.composite.stats import PROM_COUNTERS

    (name,) = [n for prefix, n, _, _ in PROM_COUNTERS if prefix == "hit_tokens"]
    registry = CollectorRegistry()
    hits = Counter(name, "doc", ["engine", "node", "child"], registry=registry)
    hits.labels("0", "decode", "nixl").inc(576)
    hits.labels("0", "decode", "lmcache").inc(512)
    usage = Gauge("vllm:kv_cache_usage_perc", "doc", ["engine"], registry=registry)
    usage.labels("0").set(0.25)
    text = generate_latest(registry).decode()
    assert gpu_check.hit_tokens_by_child(text) == {"nixl": 576.0, "lmcache": 512.0}
    assert gpu_check.kv_cache_usage(text) == 0.25


def test_the_script_dry_run_prints_the_plan() -> None:
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu-check.sh"),
            "--venv",
            sys.prefix,
            "--model",
            "/models/m",
            "--requests",
            "3",
            "--hybrid-model",
            "/models/h",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[gpu-check]")]
    assert [line.split(":")[0] for line in lines[:3]] == [
        "[gpu-check] baseline",
        "[gpu-check] prefill",
        "[gpu-check] decode",
    ]
    assert "LMCACHE_CHUNK_SIZE=64" in lines[2] and "--kv-transfer-config" in lines[2]
    assert [line.split(":")[0] for line in lines[3:5]] == [
        "[gpu-check] hybrid-baseline",
        "[gpu-check] hybrid-offload",
    ]
    assert "KVComposeHMA" in lines[4] and "OffloadingConnector" in lines[4]
    assert "workload: 3 prompts" in out.stdout
