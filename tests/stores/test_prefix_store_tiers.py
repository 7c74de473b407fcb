"""The store as a tier of a hierarchy, over vLLM's real scheduler (``SchedulerHarness``):
capacity in chunks and bytes (a chain's first chunks kept longest) with occupancy reported,
admission (prompt length, chunks seen K times), promotion of chunks another tier loaded,
and the medium a leaf reports (hit source, KV cache events).

The worker half runs for real with KV caches registered by the test (the harness has no
model). The harness calls no ``save_kv_layer`` (no attention layers), so the stores save
in the background (their writer copies blocks from the registered caches).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcompose.engine.harness import SchedulerHarness
from kvcompose.stores import store_usage
from kvcompose.stores.prefix import connector as store_connector
from kvcompose.stores.prefix.admission import FrequencySketch
from kvcompose.stores.prefix.tier import detect_medium
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

BLOCK = 32
NUM_BLOCKS = 96


def store_cfg(path: Path, **store: Any) -> dict[str, Any]:
    return {
        "kv_connector": "PrefixStoreConnector",
        "kv_connector_module_path": "kvcompose.stores",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": str(path), "save_mode": "background", **store},
    }


def harness(model_dir: Path, cfg: dict[str, Any]) -> SchedulerHarness:
    h = SchedulerHarness(
        model_dir,
        cfg,
        block_size=BLOCK,
        num_blocks=NUM_BLOCKS,
        with_worker=True,
        enable_prefix_caching=False,
    )
    gen = torch.Generator().manual_seed(0)
    h.worker_connector.register_kv_caches(
        {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                NUM_BLOCKS, 2, BLOCK, 4, 32, generator=gen
            )
            for i in range(2)
        }
    )
    return h


def run(
    h: SchedulerHarness,
    prompt: list[int],
    req_id: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> None:
    """Run one request to the end, its background writes included (the harness's steps
    are a tight loop, so the writer thread is given the time to write first)."""
    h.add_request(prompt, max_tokens=2, request_id=req_id, kv_transfer_params=kv_transfer_params)
    while req_id not in h.finished:
        h.step()
    for writer in writers(h):
        assert writer.flush(30)
    h.run_until_idle()


def writers(h: SchedulerHarness) -> list[Any]:
    wc = h.worker_connector
    children = getattr(wc, "children", None)
    conns = list(children.connectors) if children is not None else [wc]
    return [
        c.connector_worker.writer
        for c in conns
        if getattr(c, "connector_worker", None) is not None and c.connector_worker.writer
    ]


def stored_chunks(h: SchedulerHarness, prompt: list[int]) -> int:
    """Chunks of ``prompt`` a lookup finds (a request that is never scheduled)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(
        request_id="probe",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    return h.connector.connector_scheduler.stored_prefix_chunks(req)


def totals(h: SchedulerHarness) -> dict[str, Any]:
    return dict(h.worker_connector.total_stats.data)


def test_capacity_keeps_a_chains_first_chunks_and_reports_occupancy(
    tiny_model_dir: Path, tmp_path: Path
):
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", max_chunks=3))
    prompt = h.make_prompt(6 * BLOCK + 5, seed="a")
    run(h, prompt, "a")
    assert store_usage(tmp_path / "kv")["files"] == 3
    assert stored_chunks(h, prompt) == 3  # the first three: a lookup still hits
    t = totals(h)
    assert t["evictions"] == 3 and t["occupancy_chunks"] == 3
    assert t["occupancy_bytes"] == store_usage(tmp_path / "kv")["bytes"]
    chunk_bytes = t["occupancy_bytes"] // 3
    h.close()

    # A byte cap of two and a half chunks keeps two.
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv2", max_bytes=chunk_bytes * 5 // 2))
    run(h, prompt, "a")
    assert store_usage(tmp_path / "kv2")["files"] == 2
    assert stored_chunks(h, prompt) == 2
    assert totals(h)["occupancy_bytes"] <= chunk_bytes * 5 // 2
    h.close()

    # Uncapped: occupancy counted up from one scan.
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv3"))
    run(h, prompt, "a")
    run(h, h.make_prompt(2 * BLOCK + 5, seed="b"), "b")
    usage = store_usage(tmp_path / "kv3")
    t = totals(h)
    assert usage["files"] == 8 and t["evictions"] == 0
    assert (t["occupancy_chunks"], t["occupancy_bytes"]) == (usage["files"], usage["bytes"])
    h.close()


def test_admission_by_prompt_length_and_frequency(tiny_model_dir: Path, tmp_path: Path):
    h = harness(
        tiny_model_dir,
        store_cfg(tmp_path / "kv", admit_min_seen=2, admit_min_prompt_tokens=3 * BLOCK),
    )
    short = h.make_prompt(2 * BLOCK + 5, seed="short")
    long = h.make_prompt(4 * BLOCK + 5, seed="long")
    run(h, short, "s1")
    run(h, short, "s2")  # seen twice, but too short
    run(h, long, "l1")  # long enough, seen once
    assert store_usage(tmp_path / "kv")["files"] == 0
    run(h, long, "l2")  # seen twice: admitted
    assert stored_chunks(h, long) == 4
    t = h.connector.connector_scheduler.total_stats.data
    assert t["rejects"] == 2 + 2 + 4 and t["admits"] == 4
    h.close()


def premium_only(request: Any) -> bool:
    """An ``admit_when`` predicate (imported by the store as ``module:function``)."""
    return (request.kv_transfer_params or {}).get("tenant") == "premium"


def broken_predicate(request: Any) -> bool:
    raise RuntimeError("predicate bug")


@pytest.mark.parametrize(
    "admit_when",
    [
        {"param": "tenant", "equals": "premium"},
        {"predicate": f"{__name__}:premium_only"},
    ],
    ids=["param-equals", "predicate"],
)
def test_admission_by_request_condition(
    tiny_model_dir: Path, tmp_path: Path, admit_when: dict[str, Any]
):
    """``admit_when`` takes a route rule's conditions: only the requests it selects are
    saved; the others are rejected chunk by chunk and counted."""
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", admit_when=admit_when))
    free = h.make_prompt(3 * BLOCK + 5, seed="free")
    paid = h.make_prompt(2 * BLOCK + 5, seed="paid")
    run(h, free, "f1", {"tenant": "free"})
    run(h, free, "f2")  # no kv_transfer_params at all
    assert store_usage(tmp_path / "kv")["files"] == 0
    run(h, paid, "p1", {"tenant": "premium"})
    assert stored_chunks(h, paid) == 2 and stored_chunks(h, free) == 0
    t = h.connector.connector_scheduler.total_stats.data
    assert (t["rejects"], t["admits"]) == (3 + 3, 2)
    h.close()


def test_admission_condition_that_raises_rejects(tiny_model_dir: Path, tmp_path: Path):
    h = harness(
        tiny_model_dir,
        store_cfg(tmp_path / "kv", admit_when={"predicate": f"{__name__}:broken_predicate"}),
    )
    run(h, h.make_prompt(2 * BLOCK + 5, seed="x"), "x")
    assert store_usage(tmp_path / "kv")["files"] == 0
    assert h.connector.connector_scheduler.total_stats.data["rejects"] == 2
    h.close()


def test_admission_predicate_that_cannot_be_imported_fails_at_start(
    tiny_model_dir: Path, tmp_path: Path
):
    with pytest.raises(Exception, match=r"admit_when.predicate 'no_such_module_x:f' cannot be"):
        harness(
            tiny_model_dir,
            store_cfg(tmp_path / "kv", admit_when={"predicate": "no_such_module_x:f"}),
        )


def test_admission_counters_reach_vllm_stats(tiny_model_dir: Path, tmp_path: Path):
    """vLLM's scheduler collects the scheduler half's counters with the workers' ones
    (``Scheduler.update_from_output``: ``connector.get_kv_connector_stats()``)."""
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", admit_min_seen=2))
    prompt = h.make_prompt(3 * BLOCK + 5, seed="p")
    seen: list[dict[str, Any]] = []
    collect = h.connector.get_kv_connector_stats

    def recording() -> Any:
        stats = collect()
        if stats is not None:
            seen.append(dict(stats.data))
        return stats

    h.connector.get_kv_connector_stats = recording
    run(h, prompt, "a")
    run(h, prompt, "b")
    assert sum(s["rejects"] for s in seen) == 3 and sum(s["admits"] for s in seen) == 3
    h.close()


def two_tiers(
    tmp_path: Path, *, promote: bool, min_seen: int = 100, policy: str = "longest"
) -> dict[str, Any]:
    fast = prefix_store_leaf(
        "fast",
        tmp_path / "fast",
        medium="tmpfs",
        admit_min_seen=min_seen,
        promote=promote,
        save_mode="background",
    )
    slow = prefix_store_leaf("slow", tmp_path / "slow", medium="disk", save_mode="background")
    return kvcompose_config(chain("tiers", fast, slow, policy=policy))


@pytest.mark.parametrize("promote", [True, False])
def test_promotion_of_chunks_the_slow_tier_loaded(
    tiny_model_dir: Path, tmp_path: Path, promote: bool
):
    prompt = [4 + (i * 37) % 900 for i in range(5 * BLOCK + 7)]
    # Fill the slow tier alone.
    h = harness(tiny_model_dir, store_cfg(tmp_path / "slow", medium="disk"))
    run(h, prompt, "fill")
    h.close()
    assert store_usage(tmp_path / "slow")["files"] == 5

    h = harness(tiny_model_dir, two_tiers(tmp_path, promote=promote))
    run(h, prompt, "a")  # the slow tier serves it; the fast tier's rule rejects new chunks
    fast = h.connector.children.connectors[0].connector_scheduler
    counters = h.connector.counters.totals
    assert counters.get("hits.slow") == 1 and not counters.get("hits.fast")
    if promote:
        assert store_usage(tmp_path / "fast")["files"] == 5
        assert fast.total_stats.data["promotions"] == 5
        run(h, prompt, "b")  # now the fast tier serves it, and nothing is written twice
        assert counters.get("hits.fast") == 1
        assert store_usage(tmp_path / "fast")["files"] == 5
        assert fast.total_stats.data["promotions"] == 5
    else:
        assert store_usage(tmp_path / "fast")["files"] == 0
        assert fast.total_stats.data["rejects"] == 5
    h.assert_clean()  # the chain released every block its stores held for their writes
    h.close()


def test_without_a_rule_a_non_owning_store_saves_what_another_loaded(
    tiny_model_dir: Path, tmp_path: Path
):
    """What a chain does without admission or promotion: every store plans saves for every
    full prompt chunk it lacks, loaded by another child or computed (write-through), so a
    slow tier's hit is copied into the fast tier whatever the policy."""
    prompt = [4 + (i * 41) % 900 for i in range(4 * BLOCK + 3)]
    h = harness(tiny_model_dir, store_cfg(tmp_path / "slow", medium="disk"))
    run(h, prompt, "fill")
    h.close()
    h = harness(tiny_model_dir, two_tiers(tmp_path, promote=False, min_seen=1, policy="first"))
    run(h, prompt, "a")
    assert h.connector.counters.totals.get("hits.slow") == 1
    assert store_usage(tmp_path / "fast")["files"] == 4
    assert not h.connector.children.connectors[0].connector_scheduler.total_stats.data["promotions"]
    h.assert_clean()
    h.close()


def test_medium_sets_the_hit_source_and_the_events_medium(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    assert detect_medium("/dev/shm") == "tmpfs"
    assert detect_medium(tmp_path) in ("disk", "tmpfs")
    monkeypatch.setattr(store_connector, "_kv_events_on", lambda _cfg: True)
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", medium="cpu"))

    published: list[Any] = []

    class Recorder:
        def publish(self, batch: Any) -> None:
            published.extend(batch.events)

        def shutdown(self) -> None:
            pass

    h.scheduler.kv_event_publisher = Recorder()
    prompt = h.make_prompt(3 * BLOCK + 5, seed="e")
    run(h, prompt, "a")
    stored = [e for e in published if type(e).__name__ == "BlockStored"]
    assert len(stored) == 3 and {e.medium for e in stored} == {"CPU"}
    # Chained like vLLM's own events: each chunk's parent is the previous chunk's block.
    lasts = {e.block_hashes[-1] for e in stored}
    parents = [e.parent_block_hash for e in stored]
    assert parents.count(None) == 1 and all(p in lasts for p in parents if p is not None)
    h.add_request(prompt, max_tokens=2, request_id="b")
    h.step()
    req = h.requests["b"]
    assert h.connector.get_external_cache_hit_sources(req, 3 * BLOCK) == {
        CacheHitSource.HOST: 3 * BLOCK
    }
    h.run_until_idle()
    h.close()


def test_frequency_sketch_counts_and_fades():
    sketch = FrequencySketch(width=1 << 12, depth=3, reset_every=10)
    for _ in range(5):
        sketch.add("a")
    sketch.add("b")
    assert sketch.count("a") == 5 and sketch.count("b") == 1 and sketch.count("zz") == 0
    for i in range(4):  # the tenth addition halves every counter
        sketch.add(f"k{i}")
    assert sketch.count("a") == 2 and sketch.count("b") == 0


def test_evictions_are_published_as_block_removed(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(store_connector, "_kv_events_on", lambda _cfg: True)
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", medium="disk", max_chunks=2))
    published: list[Any] = []

    class Recorder:
        def publish(self, batch: Any) -> None:
            published.extend(batch.events)

        def shutdown(self) -> None:
            pass

    h.scheduler.kv_event_publisher = Recorder()
    run(h, h.make_prompt(3 * BLOCK + 5, seed="r"), "a")
    stored = [e for e in published if type(e).__name__ == "BlockStored"]
    removed = [e for e in published if type(e).__name__ == "BlockRemoved"]
    assert len(stored) == 3 and len(removed) == 1
    assert {e.medium for e in published} == {"STORAGE"}
    # The chunk evicted is the chain's last one (the first ones are kept longest).
    last = next(
        e
        for e in stored
        if e.parent_block_hash not in (None,)
        and all(e.block_hashes[-1] != o.parent_block_hash for o in stored)
    )
    assert removed[0].block_hashes == last.block_hashes
    h.close()


def test_the_gil_free_writer_writes_ordinary_safetensors_files(tmp_path: Path):
    import safetensors.torch
    from safetensors import safe_open

    from kvcompose.stores.prefix.safetensors_io import write_safetensors

    tensors = {
        "model.layers.1.attn": torch.randn(2, 2, 32, 4, 8),
        "model.layers.0.attn": torch.randn(2, 3).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "small": torch.randint(-5, 5, (7,), dtype=torch.int8),
    }
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, tensors, {"key": "k1", "num_tokens": "32"})
    back = safetensors.torch.load_file(path)
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    with safe_open(path, "pt") as fh:
        assert fh.metadata() == {"key": "k1", "num_tokens": "32"}


def test_a_non_saving_background_leaf_offers_nothing_it_never_queued(
    tiny_model_dir: Path, tmp_path: Path
):
    """A composite calls ``wait_for_save`` only on saving children, while every child's
    scheduler half plans saves: the unqueued saves are reported dropped, not offered."""
    ro = prefix_store_leaf("ro", tmp_path / "ro", save_mode="background", fields={"save": False})
    rw = prefix_store_leaf("rw", tmp_path / "rw", save_mode="background")
    h = harness(tiny_model_dir, kvcompose_config(chain("tiers", ro, rw)))
    prompt = h.make_prompt(3 * BLOCK + 5, seed="n")
    run(h, prompt, "a")
    ro_sched = h.connector.children.connectors[0].connector_scheduler
    assert not ro_sched._queued and store_usage(tmp_path / "ro")["files"] == 0
    run(h, prompt, "b")  # served by rw; ro claims nothing
    counters = h.connector.counters.totals
    assert counters.get("hits.rw") == 1 and not counters.get("hits.ro")
    h.assert_clean()
    h.close()


def test_background_evictions_wait_for_the_step_boundary(tiny_model_dir: Path, tmp_path: Path):
    """The writer thread never deletes: a chunk a lookup has just promised must still be
    there when the step loads it (the store evicts in ``wait_for_save``, between steps)."""
    h = harness(tiny_model_dir, store_cfg(tmp_path / "kv", max_chunks=1))
    h.add_request(h.make_prompt(3 * BLOCK + 5, seed="e"), max_tokens=4, request_id="a")
    h.step()
    (writer,) = writers(h)
    assert writer.flush(30)
    assert store_usage(tmp_path / "kv")["files"] == 3  # written, not evicted yet
    h.step()
    assert store_usage(tmp_path / "kv")["files"] == 1
    assert totals(h)["evictions"] == 2
    h.run_until_idle()
    h.close()
