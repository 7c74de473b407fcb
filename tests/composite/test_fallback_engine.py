"""Load-failure fallback on a real engine: the owner's async load fails for a chosen request
(kvcompose.testing.faulty_store's fault injection), vLLM (kv_load_failure_policy=recompute)
looks the request up again, kvcompose skips the failed child and the next child serves it."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id
from kvcompose.introspect import node_stats, scheduler_connector
from kvcompose.testing import faulty_store
from kvcompose.testing.real_engine import make_llm
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def run(llm: Any, requests: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    outputs = generate_by_id(llm, requests.items(), max_tokens)
    return {req_id: list(out.outputs[0].token_ids) for req_id, out in outputs.items()}


def test_failed_owner_is_skipped_and_the_next_child_serves(tiny_model, tmp_path):
    requests = {f"r{k}": [4 + (97 * k + 13 * i) % 1000 for i in range(150)] for k in range(2)}
    kw = {"block_size": 32, "enable_prefix_caching": False}
    with make_llm(tiny_model, None, **kw) as llm:
        baseline = run(llm, requests)
    a, b = tmp_path / "a", tmp_path / "b"
    fill = kvcompose_config(chain("fill", prefix_store_leaf("a", a), prefix_store_leaf("b", b)))
    with make_llm(tiny_model, fill, **kw) as llm:
        run(llm, requests, 1)
    tree = kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf(
                "a",
                a,
                load_mode="async",
                fail_load_request_ids=["r0"],
                fields={
                    "connector": faulty_store.CONNECTOR,
                    "module_path": faulty_store.MODULE_PATH,
                },
            ),
            prefix_store_leaf("b", b),
            policy="first",
        ),
        kv_load_failure_policy="recompute",
    )
    with make_llm(tiny_model, tree, **kw) as llm:
        assert run(llm, requests) == baseline
        counters = node_stats(llm)["counters"]
        # r1 from a; r0 first from a (fails), then from b
        assert counters["hits.a"] == 2 and counters["hits.b"] == 1
        assert counters["hit_tokens.b"] == 128
        assert scheduler_connector(llm).live_requests() == {}
