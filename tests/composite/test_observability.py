"""Observability on a real engine: per-node stats through vLLM's own stats path, Prometheus
metrics labelled by node, the periodic log line, and the per-request decision record."""

from __future__ import annotations

import logging
import shutil

import pytest

from kvcompose.introspect import node_stats
from kvcompose.testing.real_engine import greedy, make_llm
from kvcompose.testing.trees import chain, example_leaf, kvcompose_config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def prompts(n: int) -> list[list[int]]:
    return [[4 + (131 * k + 17 * i) % 1000 for i in range(150)] for k in range(n)]


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def sample(name: str, labels: dict[str, str]) -> float | None:
    from prometheus_client import REGISTRY

    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_two_children_of_one_class_are_reported_apart(tiny_model, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tree = kvcompose_config(chain("tiers", example_leaf("ram", a), example_leaf("disk", b)))
    with make_llm(tiny_model, tree, block_size=32, enable_prefix_caching=False) as llm:
        greedy(llm, prompts(2), 2)
    shutil.rmtree(a)  # "ram" lost its contents: "disk" must serve both requests

    capture = Capture()
    kv_logger = logging.getLogger("kvcompose")
    vllm_logger = logging.getLogger("vllm")
    old_levels = kv_logger.level, vllm_logger.level
    kv_logger.addHandler(capture)
    vllm_logger.addHandler(capture)
    kv_logger.setLevel(logging.DEBUG)
    vllm_logger.setLevel(logging.INFO)  # whatever VLLM_LOGGING_LEVEL an earlier test set
    try:
        with make_llm(
            tiny_model, tree, block_size=32, enable_prefix_caching=False, disable_log_stats=False
        ) as llm:
            greedy(llm, prompts(2), 2)
            totals = node_stats(llm)["counters"]
            llm.llm_engine.do_log_stats()
    finally:
        kv_logger.removeHandler(capture)
        vllm_logger.removeHandler(capture)
        kv_logger.setLevel(old_levels[0])
        vllm_logger.setLevel(old_levels[1])

    # the Python API: counters since start, keyed by node name, never by class
    assert totals["hit_tokens.disk"] == 256 and "hit_tokens.ram" not in totals
    assert totals["lookups"] == 2

    # Prometheus, through vLLM's own KVConnectorProm and stat loggers
    assert sample("vllm:kvcompose_hit_tokens_total", {"node": "tiers", "child": "disk"}) == 256
    assert sample("vllm:kvcompose_hits_total", {"node": "tiers", "child": "ram"}) is None
    assert sample("vllm:kvcompose_lookups_total", {"node": "tiers"}) == 2

    # the periodic KV-transfer log line, in readable form
    lines = [line for line in capture.lines if line.startswith("KV Transfer metrics")]
    assert lines and "hit_tokens.disk=256" in lines[-1]

    # the per-request decision record names the owner and what each child answered
    decisions = [line for line in capture.lines if "→ owner" in line]
    assert len(decisions) == 2
    assert all("ram=0" in d and "disk=128" in d and "owner disk" in d for d in decisions)
