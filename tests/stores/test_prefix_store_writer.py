"""The store's background writer over vLLM's real scheduler (``SchedulerHarness``).

What is checked is vLLM's delayed-free contract as the 0.32/0.33 scheduler runs it
(``Scheduler._free_request``: ``request_finished`` returning ``True`` keeps the request and
its blocks; ``_update_from_kv_xfer_finished`` frees them on ``finished_sending``;
``has_finished_requests`` keeps the engine stepping meanwhile): the blocks of a finished
request stay allocated until its chunks are written, a full queue drops saves without
stalling a step, a preemption cancels the queued copies of blocks vLLM has just freed,
and what was written loads back bit for bit.

The worker half runs for real with KV caches registered by the test (the harness has no
model); a gate on the writer thread decides when writes may happen.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from kvcompose.engine.harness import SchedulerHarness
from kvcompose.stores import store_usage

BLOCK = 32
NUM_BLOCKS = 64


def harness(model_dir: Path, path: Path, **store: Any) -> SchedulerHarness:
    cfg = {
        "kv_connector": "PrefixStoreConnector",
        "kv_connector_module_path": "kvcompose.stores",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(path), "save_mode": "background", **store},
    }
    h = SchedulerHarness(
        model_dir,
        cfg,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        with_worker=True,
        enable_prefix_caching=False,
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, 2, BLOCK, 4, 32)
        for i in range(2)
    }
    h.worker_connector.register_kv_caches(caches)
    h.caches = caches  # type: ignore[attr-defined]
    return h


def gate_writer(h: SchedulerHarness) -> threading.Event:
    """Hold the writer thread before each write until the returned event is set."""
    writer = h.worker_connector.connector_worker.writer
    write = writer._write
    gate = threading.Event()

    def gated(job: Any) -> None:
        gate.wait(30)
        write(job)

    writer._write = gated
    return gate


def worker_totals(h: SchedulerHarness) -> dict[str, Any]:
    return dict(h.worker_connector.total_stats.data)


def step_until_finished(h: SchedulerHarness, req_id: str, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if req_id in h.finished:
            return
        h.step()
    raise AssertionError(f"{req_id} did not finish: {h.describe()}")


def test_blocks_held_until_written_then_loaded_back(tiny_model_dir: Path, tmp_path: Path):
    h = harness(tiny_model_dir, tmp_path / "kv")
    gate = gate_writer(h)
    req = h.add_request(num_tokens=4 * BLOCK + 10, max_tokens=2, request_id="a")
    step_until_finished(h, "a")
    # Finished, but its 4 chunks are not written: vLLM keeps the request and its blocks.
    assert "a" in h.scheduler.requests
    assert h.num_free_blocks() < h.num_usable_blocks()
    assert h.has_work()
    assert store_usage(tmp_path / "kv")["files"] == 0
    for _ in range(3):  # steps go on while the writer waits (nothing stalls)
        h.step()
    assert "a" in h.scheduler.requests
    blocks_a = [b for b in h.history[0].scheduler_output.scheduled_new_reqs[0].block_ids[0]]

    gate.set()
    h.worker_connector.connector_worker.writer.flush(30)
    h.run_until_idle()
    h.assert_clean()
    assert store_usage(tmp_path / "kv")["files"] == 4
    totals = worker_totals(h)
    assert totals["chunks_saved"] == 4 and totals["saves_dropped"] == 0

    # The same prompt again: loaded from the files, bit for bit. (b may get some of a's
    # freed block ids, so compare with a copy taken now.)
    caches = h.caches  # type: ignore[attr-defined]
    expected = {name: kv[blocks_a[:4]].clone() for name, kv in caches.items()}
    for kv in caches.values():
        kv.zero_()
    h.add_request(list(req.prompt_token_ids), max_tokens=2, request_id="b")
    h.step()
    blocks_b = h.history[-1].scheduler_output.scheduled_new_reqs[0].block_ids[0]
    assert worker_totals(h)["chunks_loaded"] == 4
    for name, kv in caches.items():
        assert torch.equal(kv[blocks_b[:4]], expected[name])
    h.run_until_idle()
    h.assert_clean()
    h.close()


def test_full_queue_drops_saves_instead_of_stalling(tiny_model_dir: Path, tmp_path: Path):
    h = harness(tiny_model_dir, tmp_path / "kv", max_pending_saves=2)
    gate = gate_writer(h)
    h.add_request(num_tokens=6 * BLOCK + 5, max_tokens=2, request_id="a")
    step_until_finished(h, "a")
    totals = worker_totals(h)
    # The writer holds one job (waiting at the gate) and queues two more: three in all.
    assert totals["saves_dropped"] >= 3
    gate.set()
    h.worker_connector.connector_worker.writer.flush(30)
    h.run_until_idle()
    h.assert_clean()
    totals = worker_totals(h)
    assert totals["chunks_saved"] + totals["saves_dropped"] == 6
    assert store_usage(tmp_path / "kv")["files"] == totals["chunks_saved"]
    h.close()


def test_preemption_writes_the_queued_chunks_before_the_blocks_are_reused(
    tiny_model_dir: Path, tmp_path: Path
):
    h = harness(tiny_model_dir, tmp_path / "kv")
    gate = gate_writer(h)
    h.add_request(num_tokens=3 * BLOCK + 5, max_tokens=8, request_id="a")
    h.step()  # the prompt is computed; three saves queued (one waiting at the gate)
    writer = h.worker_connector.connector_worker.writer
    assert writer.pending() == 3
    h.preempt("a")
    released = threading.Timer(0.5, gate.set)  # the fence waits for the write in progress
    released.start()
    h.step()  # before this step's forward the worker writes a's queued chunks itself
    released.join()
    assert writer.pending() == 0
    assert store_usage(tmp_path / "kv")["files"] == 3
    assert worker_totals(h)["saves_dropped"] == 0
    h.run_until_idle()
    h.assert_clean()
    h.close()


def test_a_queued_chunk_is_offered_and_loaded_from_the_held_blocks(
    tiny_model_dir: Path, tmp_path: Path
):
    h = harness(tiny_model_dir, tmp_path / "kv")
    gate = gate_writer(h)
    a = h.add_request(num_tokens=3 * BLOCK + 5, max_tokens=8, request_id="a")
    h.step()  # a's three chunks are queued; nothing is written (the gate is closed)
    blocks_a = h.history[-1].scheduler_output.scheduled_new_reqs[0].block_ids[0][:3]
    caches = h.caches  # type: ignore[attr-defined]
    expected = {name: kv[blocks_a].clone() for name, kv in caches.items()}
    h.add_request(list(a.prompt_token_ids), max_tokens=2, request_id="b")
    h.step()  # b's lookup finds the queued chunks; its load copies a's blocks
    assert store_usage(tmp_path / "kv")["files"] == 0
    assert worker_totals(h)["chunks_loaded"] == 3
    blocks_b = h.history[-1].scheduler_output.scheduled_new_reqs[0].block_ids[0][:3]
    for name, kv in caches.items():
        assert torch.equal(kv[blocks_b], expected[name])
    gate.set()
    assert h.worker_connector.connector_worker.writer.flush(30)
    h.run_until_idle()
    h.assert_clean()
    assert store_usage(tmp_path / "kv")["files"] == 3
    assert not h.connector.connector_scheduler._queued  # written: no longer offered as queued
    h.close()
