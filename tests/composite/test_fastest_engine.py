"""``policy: fastest`` in a real single-process vLLM CPU engine (tiny Llama) over two of
kvcompose's stores: fast holds the shared system prompt (64 tokens), slow the whole prompt
with its reads EMULATED far slower than the engine computes (200 ms a load). The first
request's plan comes from the default prior, under which slow looks fast, so slow loads; its
load is timed, and from then on fastest loads fast's prefix and recomputes the rest, the plan
no fixed policy chooses. Outputs equal recompute's throughout."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id
from kvcompose.engine.probe import scheduler, scheduler_connector
from kvcompose.testing.real_engine import make_llm
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

_rng = random.Random(27)
SYSTEM = [_rng.randrange(4, 1024) for _ in range(64)]
PROMPT = SYSTEM + [_rng.randrange(4, 1024) for _ in range(136)]  # 200 tokens
ENGINE = {"block_size": 32, "enable_prefix_caching": False}


def run(llm: Any, req_id: str, prompt: list[int]) -> list[int]:
    out = list(generate_by_id(llm, [(req_id, prompt)], 6)[req_id].outputs[0].token_ids)
    core = llm.llm_engine.engine_core.engine_core
    while core.scheduler.has_requests():  # the stores' saves release their blocks
        core.step_fn()
    return out


def test_fastest_learns_that_the_slow_tier_does_not_pay(tiny_model: Path, tmp_path: Path):
    fast_dir, slow_dir = tmp_path / "fast", tmp_path / "slow"
    with make_llm(tiny_model, None, **ENGINE) as llm:
        reference = run(llm, "ref", PROMPT)
    # fill the tiers: fast the system prompt's two blocks, slow the prompt's six
    only_fast = kvcompose_config(chain("fill", prefix_store_leaf("fast", fast_dir)))
    with make_llm(tiny_model, only_fast, **ENGINE) as llm:
        run(llm, "system", [*SYSTEM, 5])
    only_slow = kvcompose_config(chain("fill", prefix_store_leaf("slow", slow_dir)))
    with make_llm(tiny_model, only_slow, **ENGINE) as llm:
        run(llm, "whole", PROMPT)

    slow = prefix_store_leaf(
        "slow", slow_dir, read_only=True, emulate_read={"latency_ms": 200.0, "gbps": 1.0}
    )
    tree = chain("root", prefix_store_leaf("fast", fast_dir, read_only=True), slow)
    tree["policy"] = "fastest"
    with make_llm(tiny_model, kvcompose_config(tree), **ENGINE) as llm:
        node = scheduler_connector(llm)
        outputs = [run(llm, f"r{i}", PROMPT) for i in range(3)]
        counters = node.stats_totals()["counters"]
        estimate = node.scheduler_side.costs.loads[1]
        assert not scheduler(llm).requests

    assert outputs == [reference] * 3
    # r0: slow is cold (no prior: the default 1 ms + 1 GB/s makes it look cheap), so it loads
    # a 128-token probe after fast's 64: a stitch [0, 64) + [64, 192)
    assert counters["hits.slow"] == 1 and counters["hit_tokens.slow"] == 128
    assert estimate.measured == 1 and estimate.predict(192) >= 0.2  # timed: >= 200 ms
    assert counters["plans.stitch"] == 1
    # r1, r2: fast's 64 tokens, the rest computed
    assert counters["hits.fast"] == 3 and counters["hit_tokens.fast"] == 3 * 64
    assert counters["plans.load"] == 2
    assert counters["load_seconds_actual.slow"] >= 0.2
