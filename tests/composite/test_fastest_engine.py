"""``policy: fastest`` in a real single-process vLLM CPU engine (tiny Llama) over two of
kvcompose's stores: fast holds the shared system prompt (64 tokens), slow the whole prompt
with its reads EMULATED far slower than the engine computes (200 ms a load). Both start
cold; the first request probes slow (a plan takes one cold child), its load is timed, and
from then on fastest loads fast's prefix and recomputes the rest, the plan no fixed policy
chooses. Outputs equal recompute's throughout."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id
from kvcompose.engine.probe import scheduler, scheduler_connector
from kvcompose.testing.engine import make_llm
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
    # r0: both tiers are cold (no prior), and a plan takes one cold child: each one's first
    # probe is priced at nothing, and slow's (128 tokens) saves more computing than fast's
    # (its whole 64), so r0 loads slow[0, 128)
    assert counters["hits.slow"] == 1 and counters["hit_tokens.slow"] == 128
    assert estimate.measured == 1 and estimate.predict(192) >= 0.2  # timed: >= 200 ms
    # r1: fast's probe, its whole 64 tokens (slow, still cold, would need a second probe:
    # its line, 200 ms of latency, does not beat computing at any length its hit allows);
    # r2: fast's 64 tokens; the rest computed
    assert counters["hits.fast"] == 2 and counters["hit_tokens.fast"] == 2 * 64
    assert counters["plans.load"] == 3 and "plans.stitch" not in counters
    assert counters["load_seconds_actual.slow"] >= 0.2
