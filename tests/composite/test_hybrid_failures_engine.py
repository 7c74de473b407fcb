"""Failed loads on a real engine with a hybrid model (2 KV cache groups under HMA).

vLLM's scheduler raises on invalid block ids when the model has several KV cache groups, which
kills the engine. A child raises in ``start_load_kv`` for every load, sync or async, or a
store's read fails: the node reports the failed loads by request, vLLM recomputes or another
child serves the request, the outputs equal an engine without a connector, and the engine
goes on serving.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id, make_llm
from kvcompose.engine.model import tiny_hybrid_model
from kvcompose.introspect import node_stats, scheduler_connector, worker_connector
from kvcompose.testing import faulty_store
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BLOCK = 32
ENGINE = {"block_size": BLOCK, "enable_prefix_caching": False}


def run(llm: Any, requests: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    outputs = generate_by_id(llm, requests.items(), max_tokens)
    return {req_id: list(out.outputs[0].token_ids) for req_id, out in outputs.items()}


def prompts(first: int, n: int = 2, length: int = 150) -> dict[str, list[int]]:
    return {
        f"r{k}": [4 + (97 * k + 13 * i) % 1000 for i in range(length)]
        for k in range(first, first + n)
    }


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_raising_child_on_a_hybrid_model_is_recomputed_and_the_engine_stays_up(is_async):
    model = tiny_hybrid_model()
    requests, later = prompts(0), prompts(2)
    with make_llm(model, None, **ENGINE) as llm:
        baseline = run(llm, {**requests, **later})
    raising = frozenset({"start_load_kv"})
    script("a", Behaviour(tokens=4 * BLOCK, is_async=is_async, raise_in=raising))
    tree = kvcompose_config(
        chain("root", leaf("a", connector="ScriptedHMAConnector", load_range="native")),
        kv_load_failure_policy="recompute",
    )
    tree["kv_connector"] = "KVComposeHMA"
    with make_llm(model, tree, **ENGINE) as llm:
        connector = scheduler_connector(llm)
        assert connector.scheduler_side.by_request, "the engine formed several KV cache groups"
        assert run(llm, requests) == {r: baseline[r] for r in requests}
        assert run(llm, later) == {r: baseline[r] for r in later}, "the engine goes on"
        assert node_stats(llm)["counters"]["hits.a"] == 4
        # (a raise fails every load of the child in its step: one per step at least)
        assert worker_connector().stats_totals()["counters"]["errors.a.start_load_kv"] >= 2
        assert connector.live_requests() == {}
        assert worker_connector().live_requests() == {}


def test_a_failed_store_read_on_a_hybrid_model_falls_back_to_the_next_store(tmp_path):
    """Two stores filled by one run; a's read of r0 fails (the fault-injecting store). On a
    model with several KV cache groups the store loads async and reports the failure by
    request; the node skips a for r0 on vLLM's new lookup and b serves it. The outputs equal
    an engine without a connector."""
    model = tiny_hybrid_model()
    requests = prompts(0)
    with make_llm(model, None, **ENGINE) as llm:
        baseline = run(llm, requests)
    a, b = tmp_path / "a", tmp_path / "b"
    fill = kvcompose_config(chain("fill", prefix_store_leaf("a", a), prefix_store_leaf("b", b)))
    fill["kv_connector"] = "KVComposeHMA"
    with make_llm(model, fill, **ENGINE) as llm:
        run(llm, requests, 1)
    faulty = {"connector": faulty_store.CONNECTOR, "module_path": faulty_store.MODULE_PATH}
    tree = kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf("a", a, fail_load_request_ids=["r0"], fields=faulty),
            prefix_store_leaf("b", b),
        ),
        kv_load_failure_policy="recompute",
    )
    tree["kv_connector"] = "KVComposeHMA"
    with make_llm(model, tree, **ENGINE) as llm:
        assert scheduler_connector(llm).scheduler_side.by_request
        assert run(llm, requests) == baseline
        counters = node_stats(llm)["counters"]
        # r1 from a; r0 first from a (fails), then from b
        assert counters["hits.a"] == 2 and counters["hits.b"] == 1
        assert scheduler_connector(llm).live_requests() == {}
