"""PrefixStoreConnector on the hybrid model in real single-process vLLM CPU engines, with
vLLM's hybrid KV cache manager (HMA) on: 4 layers, sliding window 64 on layers 0 and 2,
block size 32, so 2 KV cache groups.

Prompts: A has 200 tokens (6 full chunks inside A[:-1]); B = A's first 3 chunks plus a
different 54-token tail. Three engines: a baseline without connector, the store used
directly (saves A, loads part of it for B and all of it for A again, then reads noise),
and the store as the one child of a kvcompose tree under ``KVComposeHMA``.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from prefix_store_helpers import (
    BLOCK_SIZE,
    corrupt_store_files,
    delta,
    ids,
    run,
    store_engine,
    worker_stats,
)

from kvcompose.engine.llm import make_llm
from kvcompose.engine.probe import scheduler
from kvcompose.stores import store_usage
from kvcompose.testing.trees import chain, prefix_store_leaf
from kvcompose.tree import TREE_KEY

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 32
_rng = random.Random(4321)
PROMPT_A = [_rng.randrange(4, 1024) for _ in range(200)]
PROMPT_B = PROMPT_A[: 3 * CHUNK] + [_rng.randrange(4, 1024) for _ in range(54)]


def _kv_cache(llm: Any) -> dict[str, Any]:
    cfg = scheduler(llm).kv_cache_config
    return {
        "groups": sorted(type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups),
        "num_blocks": cfg.num_blocks,
    }


@pytest.fixture(scope="module")
def reference(hybrid_model_dir: Path) -> dict[str, Any]:
    """Greedy outputs and the KV cache vLLM sets up without any connector."""
    with store_engine(hybrid_model_dir, None) as llm:
        outs = run(llm, [("a", PROMPT_A), ("b", PROMPT_B)])
        kv = _kv_cache(llm)
    ref = {k: ids(v) for k, v in outs.items()}
    assert ref["a"] != ref["b"]
    assert kv["groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]
    return {**ref, "kv": kv}


def test_store_saves_then_loads_every_group(
    reference: dict[str, Any], hybrid_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "kv"
    with store_engine(hybrid_model_dir, {"path": str(path)}) as llm:
        # HMA stays on for the store: the same groups and blocks as without a connector.
        assert _kv_cache(llm) == reference["kv"]
        a = run(llm, [("a", PROMPT_A)])["a"]
        s_a = worker_stats(llm)
        assert ids(a) == reference["a"]
        assert s_a["chunks_saved"] == 6 and store_usage(path)["files"] == 6

        b = run(llm, [("b", PROMPT_B)])["b"]
        s_b = delta(worker_stats(llm), s_a)
        assert ids(b) == reference["b"]
        assert s_b["chunks_loaded"] == 3 and b.num_cached_tokens == 3 * CHUNK

        # A again (no local prefix cache): all 192 tokens from the store.
        before = worker_stats(llm)
        again = run(llm, [("a-again", PROMPT_A)])["a-again"]
        d = delta(worker_stats(llm), before)
        assert ids(again) == reference["a"]
        assert d["chunks_loaded"] == 6 and again.num_cached_tokens == 6 * CHUNK

        # Per group: the full-attention layers get all 6 blocks, the sliding ones only
        # the window before token 192 (blocks 4 and 5): 2 layers of 32 KiB blocks each.
        groups = scheduler(llm).kv_cache_config.kv_cache_groups
        full = next(i for i, g in enumerate(groups) if "Full" in type(g.kv_cache_spec).__name__)
        block = 2 * BLOCK_SIZE * 4 * 32 * 4  # K and V, 4 heads of 32, float32
        loaded = {int(k.rsplit("group", 1)[1]): v for k, v in d.items() if "loaded_group" in k}
        assert loaded == {full: 6 * 2 * block, 1 - full: 2 * 2 * block}
        assert d["bytes_loaded"] == 8 * 2 * block

        # Negative control: noise in the stored files changes the output.
        assert corrupt_store_files(path) == 7
        out = run(llm, [("noise", PROMPT_A)])["noise"]
        assert ids(out) != reference["a"]


def test_kvcompose_tree_with_the_store_keeps_hma(
    reference: dict[str, Any], hybrid_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tier"
    tree = chain("tiers", prefix_store_leaf("disk", path), policy="longest")
    cfg = {
        "kv_connector": "KVComposeHMA",
        "kv_connector_module_path": "kvcompose",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {TREE_KEY: tree},
    }
    with make_llm(hybrid_model_dir, cfg, block_size=BLOCK_SIZE, enable_prefix_caching=False) as llm:
        assert _kv_cache(llm) == reference["kv"]
        a = run(llm, [("a", PROMPT_A)])["a"]
        assert ids(a) == reference["a"] and store_usage(path)["files"] == 6
        again = run(llm, [("a-again", PROMPT_A)])["a-again"]
        assert ids(again) == reference["a"] and again.num_cached_tokens == 6 * CHUNK
        shutil.rmtree(path)
        path.mkdir()
        miss = run(llm, [("a-miss", PROMPT_A)])["a-miss"]
        assert ids(miss) == reference["a"] and miss.num_cached_tokens == 0
