"""PrefixStoreConnector in real single-process vLLM CPU engines (tiny Llama, block size 32).

Prompts: A has 200 tokens (6 full chunks inside A[:-1]); B = A's first 3 chunks (96 tokens)
plus a different 54-token tail (4 full chunks inside B[:-1], the 4th one B's own).
Four engines in all: a baseline without connector, a storing engine, a fresh sync engine
(reload, prefix reuse on top of a local hit, sync fault injection, corrupted store) and a
fresh async engine (WAITING_FOR_REMOTE_KVS, async fault injection).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from prefix_store_helpers import (
    corrupt_store_files,
    delta,
    ids,
    run,
    statuses,
    store_engine,
    worker_stats,
)

from kvcompose.stores import store_usage
from kvcompose.testing import faulty_store

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 32
_rng = random.Random(1234)
PROMPT_A = [_rng.randrange(4, 1024) for _ in range(200)]
PROMPT_B = PROMPT_A[: 3 * CHUNK] + [_rng.randrange(4, 1024) for _ in range(54)]
#: The store with fault injection (``fail_load_request_ids``), a test double.
FAULTY = {
    "kv_connector": faulty_store.CONNECTOR,
    "kv_connector_module_path": faulty_store.MODULE_PATH,
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, list[int]]:
    """Greedy outputs without any connector."""
    with store_engine(tiny_model_dir, None) as llm:
        outs = run(llm, [("a", PROMPT_A), ("b", PROMPT_B)])
    ref = {k: ids(v) for k, v in outs.items()}
    assert ref["a"] != ref["b"]
    return ref


@pytest.fixture(scope="module")
def populated_store(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run A then B through a storing engine (no local prefix cache); record what happened."""
    path = tmp_path_factory.mktemp("prefix-store") / "kv"
    rec: dict[str, Any] = {"path": path}
    with store_engine(tiny_model_dir, {"path": str(path)}) as llm:
        rec["a"] = run(llm, [("a", PROMPT_A)])["a"]
        rec["stats_a"] = worker_stats(llm)
        rec["usage_a"] = store_usage(path)
        rec["b"] = run(llm, [("b", PROMPT_B)])["b"]
        rec["stats_b"] = delta(worker_stats(llm), rec["stats_a"])
        rec["usage_b"] = store_usage(path)
    return rec


def test_store_then_prefix_reuse(populated_store, reference):
    rec = populated_store
    # A computed normally and stored as 6 chunk files (200 tokens -> 6 full chunks).
    assert ids(rec["a"]) == reference["a"]
    assert rec["stats_a"]["chunks_loaded"] == 0
    assert rec["stats_a"]["chunks_saved"] == 6 and rec["usage_a"]["files"] == 6
    # B shares A's first 3 chunks: exactly those 3 are loaded, its own 4th chunk is stored.
    assert ids(rec["b"]) == reference["b"]
    assert rec["stats_b"]["chunks_loaded"] == 3
    assert rec["stats_b"]["tokens_loaded"] == 3 * CHUNK
    assert rec["b"].num_cached_tokens == 3 * CHUNK
    assert rec["stats_b"]["chunks_saved"] == 1 and rec["usage_b"]["files"] == 7


def test_sync_reload_local_plus_store_fault_and_corruption(
    populated_store, reference, tiny_model_dir, tmp_path
):
    store = tmp_path / "kv"
    shutil.copytree(populated_store["path"], store)
    cfg = {"path": str(store), "fail_load_request_ids": ["fail-sync"]}
    with store_engine(
        tiny_model_dir,
        cfg,
        enable_prefix_caching=True,
        kv_load_failure_policy="recompute",
        **FAULTY,
    ) as llm:
        # (1) A fresh engine loads A's 6 stored chunks and generates the same tokens.
        out = run(llm, [("a", PROMPT_A)])["a"]
        s1 = worker_stats(llm)
        assert ids(out) == reference["a"]
        assert s1["chunks_loaded"] == 6 and s1["tokens_loaded"] == 6 * CHUNK
        assert s1["bytes_loaded"] > 0 and s1["chunks_saved"] == 0
        assert out.num_cached_tokens == 6 * CHUNK

        # (2) B on top of the local prefix cache: its first 3 chunks hit A's blocks
        # locally, the store supplies only the 4th chunk.
        out = run(llm, [("b", PROMPT_B)])["b"]
        d = delta(worker_stats(llm), s1)
        assert ids(out) == reference["b"]
        assert d["chunks_loaded"] == 1 and d["tokens_loaded"] == CHUNK
        assert out.num_cached_tokens == 4 * CHUNK

        # (5, sync) An injected load failure is reported as failed blocks; with the
        # "recompute" policy vLLM recomputes them and the output is unchanged.
        assert llm.reset_prefix_cache()
        before = worker_stats(llm)
        out = run(llm, [("fail-sync", PROMPT_A)])["fail-sync"]
        d = delta(worker_stats(llm), before)
        assert d["load_failures"] == 1 and d["chunks_loaded"] == 0
        assert ids(out) == reference["a"]

        # (3) Negative control: random KV in the store changes the output, so the
        # loaded KV is really what attention reads.
        assert corrupt_store_files(store) == 7
        assert llm.reset_prefix_cache()
        before = worker_stats(llm)
        out = run(llm, [("corrupt", PROMPT_A)])["corrupt"]
        d = delta(worker_stats(llm), before)
        assert d["chunks_loaded"] == 6
        assert ids(out) != reference["a"]


def test_async_load_and_async_fault(populated_store, reference, tiny_model_dir, tmp_path):
    store = tmp_path / "kv"
    shutil.copytree(populated_store["path"], store)
    cfg = {"path": str(store), "load_mode": "async", "fail_load_request_ids": ["fail-async"]}
    seen: dict[str, set[str]] = {}

    def watch(llm: Any) -> None:
        for rid, status in statuses(llm).items():
            seen.setdefault(rid, set()).add(status)

    with store_engine(tiny_model_dir, cfg, kv_load_failure_policy="recompute", **FAULTY) as llm:
        # (4) The request waits in WAITING_FOR_REMOTE_KVS while the worker loads, and
        # the output is identical.
        out = run(llm, [("a", PROMPT_A)], on_step=watch)["a"]
        s1 = worker_stats(llm)
        assert "WAITING_FOR_REMOTE_KVS" in seen["a"]
        assert ids(out) == reference["a"]
        assert s1["chunks_loaded"] == 6 and s1["tokens_loaded"] == 6 * CHUNK

        # (5, async) The failure is reported request-level (failed_recving); vLLM
        # recomputes the prompt, and the store is not offered to it again.
        out = run(llm, [("fail-async", PROMPT_A)], on_step=watch)["fail-async"]
        d = delta(worker_stats(llm), s1)
        assert "WAITING_FOR_REMOTE_KVS" in seen["fail-async"]
        assert d["load_failures"] == 1 and d["chunks_loaded"] == 0
        assert ids(out) == reference["a"]
