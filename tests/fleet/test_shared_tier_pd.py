"""Prefill/decode over real NIXL with the shared Mooncake tier on the decode side.

P (``chain [nixl]``) prefills; D (``chain/first [shared, nixl]``) decodes what P hands it,
and its Mooncake leaf saves the prompt's KV into the shared tier. A third engine E
(``chain/longest [local, shared]``), which never saw the prompt, then loads it from the shared
tier; and a second hand-off of the same prompt is served on D by the shared tier instead of
a pull (NIXL is told 0 and P's blocks are still freed). Outputs equal one engine's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine import nixl_poll
from kvcompose.engine.process import EngineProcess
from kvcompose.testing.mooncake import MooncakeCluster, node_counters
from kvcompose.testing.ports import free_port
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.fleet, pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 8
LLM_KWARGS = {"block_size": BLOCK, "enable_prefix_caching": False, "max_model_len": 1024}
PROMPTS = {"q1": prompt(256, 41)}
#: 256 tokens: Mooncake saves 8 full blocks; a lookup offers the 7 inside prompt[:-1]
SAVED, OFFERED = 256 // BLOCK, 7 * BLOCK
NIXL = {
    "kind": "leaf",
    "name": "nixl",
    "connector": "NixlConnector",
    "extra_config": {"backends": ["UCX"], "kv_lease_duration": 300},
}


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory) -> dict[str, list[int]]:
    log = tmp_path_factory.mktemp("reference") / "engine.log"
    # no Mooncake in this one: it may fork from the server that has imported vLLM once
    with EngineProcess(
        model, None, name="reference", llm_kwargs=LLM_KWARGS, log_file=log, preloaded=True
    ) as engine:
        outs = engine.generate(list(PROMPTS.values()), MAX_TOKENS)
    return {name: out[0] for name, out in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def fleet(cluster: MooncakeCluster, model: Path, tmp_path_factory) -> dict[str, EngineProcess]:
    pytest.importorskip("nixl")
    local = tmp_path_factory.mktemp("local")
    configs = {
        "prefill": kvcompose_config(chain("p", NIXL), kv_buffer_device="cpu"),
        "decode": kvcompose_config(
            chain("d", cluster.leaf("shared"), NIXL, policy="first"),
            kv_buffer_device="cpu",
            kv_load_failure_policy="recompute",
        ),
        "other": kvcompose_config(
            chain("e", prefix_store_leaf("local", local), cluster.leaf("shared"), policy="longest"),
            kv_load_failure_policy="recompute",
        ),
    }
    engines = {
        name: cluster.engine(
            name,
            model,
            cfg,
            llm_kwargs=LLM_KWARGS,
            env={**nixl_poll.environment(), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            wait=False,
        )
        for name, cfg in configs.items()
    }
    for engine in engines.values():  # started side by side; the cluster stops them all
        engine.wait_started()
    return engines


def handoff(p: EngineProcess, d: EngineProcess, tokens: list[int]) -> list[int]:
    """The proxy's flow: P prefills (1 token, ``do_remote_decode``), D decodes with P's
    hand-off; D's tokens."""
    ((_, params),) = p.generate([tokens], 1, {"do_remote_decode": True})
    assert params and params.get("do_remote_prefill"), f"P returned no hand-off: {params}"
    ((out, _),) = d.generate([tokens], MAX_TOKENS, [params])
    return out


def wait_keys(cluster: MooncakeCluster, at_least: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while len(cluster.keys()) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(cluster.keys())


def diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_d_shares_what_it_pulled_and_serves_a_repeat_from_the_shared_tier(
    fleet, empty_store, reference
):
    p, d, e = fleet["prefill"], fleet["decode"], fleet["other"]
    # (1) P -> D over NIXL; D's Mooncake leaf saves the prompt's blocks to the shared tier
    before = d.call(node_counters)
    assert handoff(p, d, PROMPTS["q1"]) == reference["q1"]
    hits = diff(d.call(node_counters), before)
    assert hits.get("hit_tokens.nixl", 0) > 0 and "hit_tokens.shared" not in hits, hits
    assert p.wait_idle(timeout=60), "P kept the prefill request's blocks"
    assert wait_keys(empty_store, SAVED) == SAVED
    print(f"\nhand-off 1 on D: {hits}; keys in Mooncake: {len(empty_store.keys())}")

    # (2) E never saw q1: it loads what D saved from the shared tier
    before = e.call(node_counters)
    assert e.generate([PROMPTS["q1"]], MAX_TOKENS)[0][0] == reference["q1"]
    hits = diff(e.call(node_counters), before)
    assert hits.get("hit_tokens.shared") == OFFERED, hits

    # (3) the same prompt handed to D again: the shared tier (first) serves it, NIXL is told
    # 0 and P's blocks are freed all the same
    before = d.call(node_counters)
    assert handoff(p, d, PROMPTS["q1"]) == reference["q1"]
    hits = diff(d.call(node_counters), before)
    assert hits.get("hit_tokens.shared") == OFFERED and "hit_tokens.nixl" not in hits, hits
    assert p.wait_idle(timeout=60), "P kept the prefill request's blocks"
    print(f"hand-off 2 on D: {hits}")
