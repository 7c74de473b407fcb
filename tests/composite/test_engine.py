"""The composite end to end in real vLLM engines (CPU), with real child connectors:
vLLM's ExampleConnector (whole-prompt disk store) and kvcompose's PrefixStoreConnector
(prefix-aware chunk store). Greedy outputs are compared with a run without any connector."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcompose.introspect import node_stats, scheduler_connector
from kvcompose.testing.real_engine import greedy, make_llm
from kvcompose.testing.trees import (
    chain,
    example_leaf,
    kvcompose_config,
    multiconnector_config,
    prefix_store_leaf,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 6


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return [
        [4 + (131 * (k + seed) + 17 * i + (i * i) % 11) % 1000 for i in range(length)]
        for k in range(n)
    ]


def engine(model: Path, config: dict[str, Any] | None, **kw: Any) -> Any:
    return make_llm(model, config, block_size=BLOCK, enable_prefix_caching=False, **kw)


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> dict[str, list[list[int]]]:
    """Greedy outputs without any connector, for every prompt set used here."""
    sets = {"short": prompts(2, 150), "long": prompts(1, 260, seed=5)}
    with engine(tiny_model, None) as llm:
        return {name: greedy(llm, ps, MAX_TOKENS) for name, ps in sets.items()}


def hits(llm: Any) -> dict[str, int]:
    return {k: v for k, v in node_stats(llm)["counters"].items() if k.startswith("hit_tokens.")}


def test_fanout_save_delete_one_store_load_from_the_other(tiny_model, baseline, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tree = kvcompose_config(chain("tiers", example_leaf("a", a), example_leaf("b", b)))
    with engine(tiny_model, tree) as llm:
        assert greedy(llm, prompts(2, 150), MAX_TOKENS) == baseline["short"]
    assert list(a.rglob("*.safetensors")) and list(b.rglob("*.safetensors")), "every child saves"
    shutil.rmtree(a)
    with engine(tiny_model, tree) as llm:
        assert greedy(llm, prompts(2, 150), MAX_TOKENS) == baseline["short"]
        assert hits(llm) == {"hit_tokens.b": 2 * 128}, "b (the only store left) serves both"
        assert scheduler_connector(llm).live_requests() == {}


def test_corrupted_store_changes_the_output(tiny_model, baseline, tmp_path):
    """The negative control: the loaded KV is really used."""
    a = tmp_path / "a"
    tree = kvcompose_config(chain("tiers", example_leaf("a", a)))
    with engine(tiny_model, tree) as llm:
        greedy(llm, prompts(2, 150), MAX_TOKENS)
    gen = torch.Generator().manual_seed(0)
    for f in a.rglob("*.safetensors"):
        kv = load_file(f)["kv_cache"]
        save_file({"kv_cache": torch.randn(kv.shape, generator=gen, dtype=kv.dtype) * 5}, f)
    with engine(tiny_model, tree) as llm:
        out = greedy(llm, prompts(2, 150), MAX_TOKENS)
        assert hits(llm) == {"hit_tokens.a": 2 * 128}
    assert out != baseline["short"]


def fill(model: Path, store: Path, prompt: list[int]) -> None:
    with engine(model, kvcompose_config(chain("fill", prefix_store_leaf("s", store)))) as llm:
        greedy(llm, [prompt], 1)


def test_longest_picks_the_longer_prefix_where_first_picks_the_shorter(
    tiny_model, baseline, tmp_path
):
    (long_prompt,) = prompts(1, 260, seed=5)
    short, deep = tmp_path / "short", tmp_path / "deep"
    fill(tiny_model, short, long_prompt[:70])  # 2 chunks of 32 tokens
    fill(tiny_model, deep, long_prompt)  # 8 chunks (256 tokens of 259)
    for policy, expected in (
        ("first", {"hit_tokens.short": 64}),
        ("longest", {"hit_tokens.deep": 256}),
    ):
        load_only = {"save": False}
        tree = kvcompose_config(
            chain(
                "tiers",
                prefix_store_leaf("short", short, fields=load_only),
                prefix_store_leaf("deep", deep, fields=load_only),
                policy=policy,
            )
        )
        with engine(tiny_model, tree) as llm:
            assert greedy(llm, [long_prompt], MAX_TOKENS) == baseline["long"]
            assert hits(llm) == expected, policy


def test_nested_tree_end_to_end(tiny_model, baseline, tmp_path):
    """root = chain/longest( route(param "tier"=="fast" → fast, default → chain/first(warm,
    cold)), archive )  — saves everywhere, loads through two levels of nesting."""
    dirs = {n: tmp_path / n for n in ("fast", "warm", "cold", "archive")}
    route = {
        "kind": "route",
        "name": "pick",
        "default": "slow",
        "rules": [{"child": "fast", "param": "tier", "equals": "fast"}],
        "children": [
            prefix_store_leaf("fast", dirs["fast"]),
            chain(
                "slow",
                prefix_store_leaf("warm", dirs["warm"]),
                prefix_store_leaf("cold", dirs["cold"], load_mode="async"),
            ),
        ],
    }
    tree = kvcompose_config(
        chain("root", route, prefix_store_leaf("archive", dirs["archive"]), policy="longest")
    )
    ps = prompts(2, 150)
    with engine(tiny_model, tree) as llm:
        assert greedy(llm, ps, MAX_TOKENS) == baseline["short"]
    for d in dirs.values():
        assert any(d.iterdir()), f"{d.name} saved nothing"
    shutil.rmtree(dirs["warm"])
    shutil.rmtree(dirs["archive"])
    with engine(tiny_model, tree) as llm:
        out = greedy(llm, ps, MAX_TOKENS, kv_transfer_params=[{"tier": "fast"}, None])
        assert out == baseline["short"]
        stats = node_stats(llm)
        assert stats["counters"]["hit_tokens.pick"] == 2 * 128
        pick = stats["children"]["pick"]
        assert pick["counters"]["hit_tokens.fast"] == 128  # the routed request
        assert pick["children"]["slow"]["counters"]["hit_tokens.cold"] == 128  # async, nested
        assert scheduler_connector(llm).live_requests() == {}


def test_multiconnector_json_works_unchanged_through_compat(tiny_model, baseline, tmp_path):
    """An existing MultiConnector user adds one line: kv_connector_module_path."""
    a, b = tmp_path / "a", tmp_path / "b"
    config = multiconnector_config(example_leaf("a", a), example_leaf("b", b))
    config["kv_connector_module_path"] = "kvcompose.compat"
    with engine(tiny_model, config) as llm:
        assert greedy(llm, prompts(2, 150), MAX_TOKENS) == baseline["short"]
        assert type(scheduler_connector(llm)).__module__ == "kvcompose.compat"
    shutil.rmtree(a)
    with engine(tiny_model, config) as llm:
        assert greedy(llm, prompts(2, 150), MAX_TOKENS) == baseline["short"]
        counters = node_stats(llm)["counters"]
        assert sum(v for k, v in counters.items() if k.startswith("hit_tokens.")) == 2 * 128
