"""LMCache's multi-process mode on real engines: vLLM's ``LMCacheMPConnector`` against one
``lmcache server``, given to vLLM directly and as a leaf of kvcompose trees.

Engines, all running for the whole module, one server:

- ``reference``: no connector (recompute);
- ``a``, ``b``: ``LMCacheMPConnector`` given to vLLM directly;
- ``longest``, ``first``: ``chain [store, lmcache]`` with that policy, each with a local
  ``PrefixStoreConnector`` directory of its own, the LMCache leaf ``on_error: miss`` and
  vLLM's ``kv_load_failure_policy: recompute``.

A prompt is 256 tokens (8 blocks of 32, 4 LMCache chunks of 64) unless said otherwise:
LMCache finds the whole prompt and loads 255 tokens (vLLM computes the last one), the store
finds the 7 blocks inside ``prompt[:-1]``. Who loaded what comes from vLLM's
``external_prefix_cache_hits`` and kvcompose's per-child counters (``hit_tokens.<child>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.process import EngineProcess
from kvcompose.testing.lmcache_engine import (
    corrupt_after_next_load,
    corruption_report,
    external_hit_tokens,
)
from kvcompose.testing.lmcache_server import LMCacheServer
from kvcompose.testing.mooncake import node_counters
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

pytestmark = [pytest.mark.engine, pytest.mark.lmcache, pytest.mark.timeout(600)]

BLOCK = 32  # LMCache's chunk (the server fixture's) is two blocks
LLM_KWARGS = {"block_size": BLOCK, "enable_prefix_caching": False, "max_model_len": 1024}

MAX_TOKENS = 6
#: prompts by name; distinct seeds share no prefix. "tie" is 200 tokens: the store finds the
#: 6 blocks inside prompt[:-1] (192 tokens), LMCache its 3 whole chunks (192 tokens).
PROMPTS = {name: prompt(n, seed) for name, n, seed in [
    ("direct", 256, 41), ("neg", 256, 42), ("leaf", 256, 43), ("leaf-neg", 256, 44),
    ("tie", 200, 45), ("first", 256, 46),
]}  # fmt: skip
#: what LMCache loads of a 256-token prompt it holds whole; what the store loads of it
WHOLE, STORE = 255, 7 * BLOCK


@pytest.fixture(scope="module")
def engines(server: LMCacheServer, model: Path, tmp_path_factory) -> dict[str, EngineProcess]:
    """The module's engines, started side by side; the server's ``stop`` ends them all."""
    tmp = tmp_path_factory.mktemp("stores")
    lmcache = server.leaf("lmcache", fields={"on_error": "miss"})
    configs: dict[str, dict[str, Any] | None] = {
        "reference": None,
        "a": server.connector_config(),
        "b": server.connector_config(),
    }
    for policy in ("longest", "first"):
        tree = chain("tiers", prefix_store_leaf("store", tmp / policy), lmcache, policy=policy)
        configs[policy] = kvcompose_config(tree, kv_load_failure_policy="recompute")
    out = {
        name: server.engine(name, model, cfg, llm_kwargs=LLM_KWARGS, wait=False)
        for name, cfg in configs.items()
    }
    for engine in out.values():
        engine.wait_started()
    return out


@pytest.fixture(scope="module")
def reference(engines: dict[str, EngineProcess]) -> dict[str, list[int]]:
    """Every prompt's greedy output, computed by the engine without a connector."""
    outs = engines["reference"].generate(list(PROMPTS.values()), MAX_TOKENS)
    return {name: out[0] for name, out in zip(PROMPTS, outs, strict=True)}


def run(engine: EngineProcess, name: str) -> tuple[list[int], int]:
    """Greedy output of prompt ``name`` on ``engine``, and the tokens it loaded for it."""
    before = engine.call(external_hit_tokens)
    tokens = engine.generate([PROMPTS[name]], MAX_TOKENS)[0][0]
    return tokens, int(engine.call(external_hit_tokens) - before)


def hits(engine: EngineProcess, run_it: str) -> tuple[list[int], dict[str, float]]:
    """Greedy output of prompt ``run_it`` on a kvcompose engine, and its per-child hit
    tokens for it."""
    before = engine.call(node_counters)
    tokens = engine.generate([PROMPTS[run_it]], MAX_TOKENS)[0][0]
    after = engine.call(node_counters)
    return tokens, {
        k.removeprefix("hit_tokens."): v - before.get(k, 0)
        for k, v in after.items()
        if k.startswith("hit_tokens.") and v != before.get(k, 0)
    }


def test_a_second_engine_loads_the_prefix_the_first_stored(engines, reference):
    """LMCache given to vLLM directly: A computes and stores, B loads it all (255 of 256
    tokens) from the server with recompute's output."""
    a, b = engines["a"], engines["b"]
    assert run(a, "direct") == (reference["direct"], 0)
    assert run(b, "direct") == (reference["direct"], WHOLE)


def test_negative_control_noise_in_the_loaded_blocks_changes_the_output(engines, reference):
    """B loads what A stored, and its blocks are overwritten with noise right after the
    load: the output changes, so B's output above came from the KV it loaded."""
    a, b = engines["a"], engines["b"]
    assert run(a, "neg") == (reference["neg"], 0)
    b.call(corrupt_after_next_load)
    tokens, loaded = run(b, "neg")
    assert loaded == WHOLE
    assert list(b.call(corruption_report).values()) == [256 // BLOCK]
    assert tokens != reference["neg"]


def test_as_a_kvcompose_leaf_it_loads_what_a_direct_engine_stored_and_back(engines, reference):
    """The LMCache leaf of a kvcompose chain loads the prefix a direct engine stored, and
    stores what it computes for a direct engine to load: same keys, same server."""
    a, b, tree = engines["a"], engines["b"], engines["longest"]
    assert run(a, "leaf") == (reference["leaf"], 0)
    assert hits(tree, "leaf") == (reference["leaf"], {"lmcache": WHOLE})
    tokens, by_child = hits(tree, "first")  # computed by the tree: stored in both tiers
    assert (tokens, by_child) == (reference["first"], {})
    assert run(b, "first") == (reference["first"], WHOLE)


def test_negative_control_as_a_leaf(engines, reference):
    a, tree = engines["a"], engines["longest"]
    assert run(a, "leaf-neg") == (reference["leaf-neg"], 0)
    tree.call(corrupt_after_next_load)
    tokens, by_child = hits(tree, "leaf-neg")
    assert by_child == {"lmcache": WHOLE}
    assert tokens != reference["leaf-neg"]
