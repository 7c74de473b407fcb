"""PrefixStoreConnector with 2 KV cache groups, on vLLM's real scheduler (``SchedulerHarness``
over the hybrid model: a sliding-window group over 64 tokens and a full-attention group,
block size 32, its worker half running on registered caches). The harness has no forward
(no ``save_kv_layer`` with tensors), so saves here are background saves, which the writer
takes from the registered caches; the engine tests cover synchronous saves.

What is checked: vLLM keeps HMA on for the store; a save stores every block of every group
and a load restores ``[0, n)`` in the full-attention group and only the window before ``n`` in
the sliding group, each from its own block ids, leaving the null block alone; a chunk whose
sliding blocks vLLM freed before it was complete is not saved; background saves copy the
sliding blocks before vLLM reuses them; a failed load is reported by request (vLLM's
``Scheduler._handle_invalid_blocks`` raises on block ids under several groups) under both of
vLLM's failure policies.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_harness import (
    BLOCK,
    group_index,
    hybrid_harness,
    layers_of,
    store_transfer_config,
)

from kvcompose.stores import store_usage
from kvcompose.stores.prefix.groups import NULL_BLOCK_ID
from kvcompose.stores.prefix.keys import chunk_keys, request_salt
from kvcompose.testing import faulty_store

#: 200 tokens: 6 full chunks inside prompt[:-1]; a load of 192 tokens leaves the window
#: 128..191 (blocks 4 and 5) in the sliding group.
PROMPT = 200


def _blocks(h: Any, req_id: str) -> tuple[list[int], ...]:
    return h.scheduler.kv_cache_manager.get_block_ids(req_id)


def _finish(h: Any, req_id: str, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if req_id in h.finished:
            return
        h.step()
    raise AssertionError(f"{req_id} did not finish: {h.describe()}")


def _store(path: Path, **store: Any) -> dict[str, Any]:
    return store_transfer_config(path, save_mode="background", **store)


def _written(h: Any) -> None:
    """Wait for the background writer, then let vLLM free what it held."""
    assert h.worker_connector.connector_worker.writer.flush(30)
    h.run_until_idle()


def _block_bytes(h: Any) -> int:
    kv = next(iter(h.caches.values()))
    return kv[0].numel() * kv.element_size()


def test_hma_stays_on_with_two_groups(hybrid_model_dir: Path, tmp_path: Path) -> None:
    h = hybrid_harness(hybrid_model_dir, store_transfer_config(tmp_path / "kv"))
    assert not h.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in h.kv_cache_config.kv_cache_groups)
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert h.connector.scheduler.groups.windowed[group_index(h, sliding=True)] is True
    h.close()


def test_save_every_block_then_load_window_per_group(
    hybrid_model_dir: Path, tmp_path: Path
) -> None:
    h = hybrid_harness(hybrid_model_dir, _store(tmp_path / "kv"))
    sw, full = group_index(h, sliding=True), group_index(h, sliding=False)
    a = h.add_request(num_tokens=PROMPT, max_tokens=1, request_id="a")
    h.step()
    # Every block of both groups is real in the step that computes the prompt (vLLM frees
    # the sliding ones behind the window once a finishes, in this step).
    blocks_a = h.history[-1].scheduler_output.scheduled_new_reqs[0].block_ids
    assert all(NULL_BLOCK_ID not in ids[:6] for ids in blocks_a)
    expected = {
        name: h.caches[name][blocks_a[g][:6]].clone()
        for g in (sw, full)
        for name in layers_of(h, g)
    }
    _finish(h, "a")
    _written(h)
    assert store_usage(tmp_path / "kv")["files"] == 6
    saved = h.worker_connector.total_stats.bytes_by_group("saved")
    block = _block_bytes(h)
    # 6 chunks, 2 layers per group, every block of each group stored.
    assert saved == {sw: 6 * 2 * block, full: 6 * 2 * block}

    # Everything else is noise now; the null block holds a sentinel.
    for kv in h.caches.values():
        kv.normal_()
    null_before = {name: kv[NULL_BLOCK_ID].clone() for name, kv in h.caches.items()}
    h.add_request(list(a.prompt_token_ids), max_tokens=1, request_id="b")
    h.step()  # lookup, allocation, the worker loads (async: reported in this step)
    assert h.scheduler.requests["b"].status.name == "WAITING_FOR_REMOTE_KVS"
    blocks_b = _blocks(h, "b")
    assert blocks_b[sw][:4] == [NULL_BLOCK_ID] * 4
    assert NULL_BLOCK_ID not in blocks_b[sw][4:6] and NULL_BLOCK_ID not in blocks_b[full][:6]
    for name in layers_of(h, full):
        assert torch.equal(h.caches[name][blocks_b[full][:6]], expected[name])
    for name in layers_of(h, sw):
        assert torch.equal(h.caches[name][blocks_b[sw][4:6]], expected[name][4:6])
    for name, kv in h.caches.items():
        assert torch.equal(kv[NULL_BLOCK_ID], null_before[name])
    loaded = h.worker_connector.total_stats.bytes_by_group("loaded")
    assert loaded == {sw: 2 * 2 * block, full: 6 * 2 * block}
    _finish(h, "b")
    scheduled = [r.scheduled["b"] for r in h.history if "b" in r.scheduled]
    assert scheduled == [PROMPT - 6 * BLOCK]  # the rest of the prompt, computed
    h.run_until_idle()
    h.assert_clean()
    h.close()


def test_chunk_whose_sliding_blocks_were_freed_is_not_saved(
    hybrid_model_dir: Path, tmp_path: Path
) -> None:
    # Chunks of 4 blocks (128 tokens), prefill in pieces of 100 tokens: chunk 0 completes in
    # the second step, after vLLM freed its first sliding block (behind the window of token
    # 100); chunk 1 completes in the third, all its blocks still held.
    h = hybrid_harness(
        hybrid_model_dir,
        _store(tmp_path / "kv", chunk_blocks=4),
        max_num_batched_tokens=100,
    )
    sw = group_index(h, sliding=True)
    req = h.add_request(num_tokens=300, max_tokens=1, request_id="a")
    first = None
    for _ in range(3):
        h.step()
        ids = _blocks(h, "a")[sw]
        first = ids[0] if first is None else first
    assert ids[0] == NULL_BLOCK_ID  # freed behind the window
    _finish(h, "a")
    _written(h)
    salt = request_salt(h.connector.scheduler.salt, req)
    keys = chunk_keys(list(req.prompt_token_ids), 4 * BLOCK, salt)
    stored = {p.name.split(".")[0] for p in (tmp_path / "kv").iterdir()}
    assert stored == {keys[1]}
    h.close()


def test_background_save_copies_sliding_blocks_before_vllm_reuses_them(
    hybrid_model_dir: Path, tmp_path: Path
) -> None:
    import safetensors.torch

    h = hybrid_harness(hybrid_model_dir, _store(tmp_path / "kv"))
    sw = group_index(h, sliding=True)
    writer = h.worker_connector.connector_worker.writer
    write, gate = writer._write, threading.Event()

    def gated(job: Any) -> Any:
        gate.wait(30)
        return write(job)

    writer._write = gated
    req = h.add_request(num_tokens=PROMPT, max_tokens=3, request_id="a")
    h.step()
    sliding_ids = _blocks(h, "a")[sw][:6]
    expected = {name: h.caches[name][sliding_ids].clone() for name in layers_of(h, sw)}
    _finish(h, "a")
    # vLLM freed a's sliding blocks behind the window while it decoded: another request's
    # forward may write them before the writer runs. Do that write.
    assert _blocks(h, "a")[sw][:4] == [NULL_BLOCK_ID] * 4
    for name in layers_of(h, sw):
        h.caches[name][sliding_ids[:4]] = 7.0
    gate.set()
    assert writer.flush(30)
    h.run_until_idle()
    h.assert_clean()
    salt = request_salt(h.connector.scheduler.salt, req)
    keys = chunk_keys(list(req.prompt_token_ids), BLOCK, salt)
    for i, key in enumerate(keys[:6]):
        stored = safetensors.torch.load_file(str(tmp_path / "kv" / f"{key}.safetensors"))
        for name in layers_of(h, sw):
            assert torch.equal(stored[name][0], expected[name][i]), (i, name)
    h.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_is_reported_by_request(
    hybrid_model_dir: Path, tmp_path: Path, policy: str
) -> None:
    path = tmp_path / "kv"
    h = hybrid_harness(hybrid_model_dir, _store(path))
    a = h.add_request(num_tokens=PROMPT, max_tokens=1, request_id="a")
    _finish(h, "a")
    _written(h)
    h.close()
    assert store_usage(path)["files"] == 6

    # A store whose load of "b" fails, even with the configured sync load_mode: under 2
    # groups the load is async and fails by request (a block id would make vLLM raise).
    cfg = store_transfer_config(
        path, faulty_store.CONNECTOR, load_mode="sync", fail_load_request_ids=["b"]
    )
    h = hybrid_harness(hybrid_model_dir, cfg, kv_load_failure_policy=policy)
    h.add_request(list(a.prompt_token_ids), max_tokens=2, request_id="b")
    h.run_until_idle()
    outputs = [r.kv_connector_output for r in h.history if r.kv_connector_output is not None]
    assert any("b" in (o.failed_recving or ()) for o in outputs)
    assert not any(o.invalid_block_ids for o in outputs)
    finished = h.finished["b"]
    if policy == "recompute":
        assert finished.finish_reason.name == "LENGTH" and len(finished.output_token_ids) == 2
        # Recomputed from token 0 once the load failed.
        assert PROMPT in [r.scheduled.get("b") for r in h.history]
    else:
        assert finished.finish_reason.name == "ERROR"
    h.assert_clean()
    h.close()
