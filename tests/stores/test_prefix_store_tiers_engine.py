"""Two kvcompose stores as tiers in a real single-process vLLM CPU engine (tiny Llama):
background saves give the same outputs as no connector and release every block, the
per-tier Prometheus metrics are labelled by node, and vLLM's
``vllm:prompt_tokens_cached_by_source`` splits hits by the tier's medium."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvcompose.engine.llm import generate_by_id
from kvcompose.engine.probe import scheduler
from kvcompose.testing.real_engine import make_llm
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

_rng = random.Random(77)
PROMPT = [_rng.randrange(4, 1024) for _ in range(200)]


def sample(name: str, labels: dict[str, str]) -> float | None:
    from prometheus_client import REGISTRY

    total = None
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + s.value
    return total


def run(llm, req_id: str) -> list[int]:
    out = list(generate_by_id(llm, [(req_id, PROMPT)], 6)[req_id].outputs[0].token_ids)
    # Background saves: vLLM keeps stepping until the held blocks are released.
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_requests():
        core.step_fn()
    return out


def test_tiers_in_an_engine(tiny_model_dir: Path, tmp_path: Path):
    with make_llm(tiny_model_dir, None, block_size=32, enable_prefix_caching=False) as llm:
        reference = run(llm, "ref")

    fast = prefix_store_leaf(
        "fast",
        tmp_path / "fast",
        medium="tmpfs",
        save_mode="background",
        admit_min_seen=2,
        promote=True,
    )
    slow = prefix_store_leaf("slow", tmp_path / "slow", medium="disk", save_mode="background")
    cfg = kvcompose_config(chain("tiers", fast, slow, policy="longest"))
    with make_llm(
        tiny_model_dir, cfg, block_size=32, enable_prefix_caching=False, disable_log_stats=False
    ) as llm:
        assert run(llm, "a") == reference  # computed; slow saves it, fast rejects (seen once)
        assert run(llm, "b") == reference  # slow serves it; fast gets it as a promotion
        assert run(llm, "c") == reference  # fast serves it
        sched = scheduler(llm)
        assert not sched.requests
        pool = sched.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        llm.llm_engine.do_log_stats()

    chunks = (len(PROMPT) - 1) // 32  # 6 chunks inside prompt[:-1]
    tokens = chunks * 32
    assert sample("vllm:kvcompose_store_tokens_loaded_total", {"tier": "slow"}) == tokens
    assert sample("vllm:kvcompose_store_tokens_loaded_total", {"tier": "fast"}) == tokens
    assert sample("vllm:kvcompose_store_promotions_total", {"tier": "fast"}) == chunks
    assert sample("vllm:kvcompose_store_rejects_total", {"tier": "fast"}) == chunks
    assert sample("vllm:prompt_tokens_cached_by_source_total", {"source": "host"}) == tokens
    assert sample("vllm:prompt_tokens_cached_by_source_total", {"source": "disk"}) == tokens
