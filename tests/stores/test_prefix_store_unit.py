"""PrefixStoreConnector without an engine: hashing, chunking, the scheduler side's
lookup/load/save planning against fake scheduler outputs, and the worker side's
save/load round trip on fake KV-cache tensors."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcompose.stores import PrefixStoreConfig, PrefixStoreStats, chunk_keys, store_usage
from kvcompose.stores.prefix import (
    ChunkLoad,
    LoadSpec,
    PrefixStoreConnector,
    PrefixStoreMetadata,
    SaveSpec,
    chunk_file_name,
    lookup_limit_chunks,
)
from kvcompose.testing import faulty_store
from kvcompose.testing.cpu_tiles import cpu_tiles_to_kv
from kvcompose.testing.faulty_store import FaultyPrefixStoreConfig, request_id_matches

BS = 32

# ----------------------------------------------------------------------------- hashing


def test_chunk_keys_share_prefix_and_chain():
    a = list(range(100, 200))  # 100 tokens -> 3 full chunks of 32
    b = a[:64] + [7] * 40  # shares 2 chunks
    ka, kb = chunk_keys(a, BS), chunk_keys(b, BS)
    assert len(ka) == 3 and len(kb) == 3
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert len(set(ka)) == 3 and all(len(k) == 32 for k in ka)
    # A change in the first chunk changes every later key (chained), even with
    # identical later tokens.
    c = [0, *a[1:]]
    kc = chunk_keys(c, BS)
    assert all(x != y for x, y in zip(ka, kc, strict=True))
    # Only full chunks; deterministic; max_chunks caps.
    assert chunk_keys(a[:31], BS) == []
    assert chunk_keys(a, BS) == ka
    assert chunk_keys(a, BS, max_chunks=1) == ka[:1]
    # Salt and chunk size separate namespaces.
    assert chunk_keys(a, BS, salt="other")[0] != ka[0]
    assert chunk_keys(a, 64)[0] not in ka
    # Token boundaries matter: [1, 23] and [12, 3] must not collide.
    assert chunk_keys([1, 23], 2) != chunk_keys([12, 3], 2)
    with pytest.raises(ValueError):
        chunk_keys(a, 0)


def test_lookup_never_counts_the_last_token():
    assert lookup_limit_chunks(64, 32) == 1  # prompt[:-1] = 63 tokens
    assert lookup_limit_chunks(65, 32) == 2
    assert lookup_limit_chunks(1, 32) == 0
    assert lookup_limit_chunks(0, 32) == 0


def test_request_id_matching():
    assert request_id_matches("fail", ["fail"])
    assert request_id_matches("fail-1a2b3c4d", ["fail"])  # vLLM's random suffix
    assert not request_id_matches("fail-sync-1a2b3c4d", ["fail"])
    assert not request_id_matches("10-1a2b3c4d", ["1"])
    assert not request_id_matches("x", [])


def test_store_usage(tmp_path):
    assert store_usage(tmp_path / "missing") == {"files": 0, "bytes": 0}
    (tmp_path / chunk_file_name("ab")).write_bytes(b"x" * 10)
    (tmp_path / chunk_file_name("cd")).write_bytes(b"x" * 5)
    (tmp_path / ".cd.safetensors.123.tmp").write_bytes(b"x" * 99)  # write in progress
    assert store_usage(tmp_path) == {"files": 2, "bytes": 15}


def test_config_parsing(tmp_path):
    cfg = PrefixStoreConfig.from_extra_config({"path": str(tmp_path)})
    assert (cfg.load_mode, cfg.chunk_blocks, cfg.max_chunks, cfg.read_only) == (
        "sync",
        1,
        None,
        False,
    )
    cfg = PrefixStoreConfig.from_extra_config(
        {
            "path": tmp_path,  # a path object is accepted too
            "load_mode": "async",
            "chunk_blocks": 2,
            "max_chunks": 5,
            "read_only": True,
            "namespace": None,
        }
    )
    assert cfg.path == str(tmp_path) and cfg.chunk_blocks == 2 and cfg.max_chunks == 5
    # One line naming the key, as an engine's start-up failure shows it.
    p = str(tmp_path)
    for bad, message in (
        ({}, "missing required key 'path' (directory of the store, created if missing)"),
        ({"path": ""}, "path: must not be empty"),
        (
            {"path": p, "load_mode": "lazy"},
            "load_mode: must be one of 'sync', 'async', got a string ('lazy')",
        ),
        ({"path": p, "chunk_blocks": 0}, "chunk_blocks: must be >= 1, got 0"),
        (
            {"path": p, "chunk_blocks": True},
            "chunk_blocks: expected an integer, got a boolean (True)",
        ),
        ({"path": p, "max_chunks": 0}, "max_chunks: must be >= 1, got 0"),
        ({"path": p, "read_only": "yes"}, "read_only: expected a boolean, got a string ('yes')"),
        ({"path": p, "namespace": 3}, "namespace: expected a string, got an integer (3)"),
        (
            {"path": p, "shared_storage_path": "/tmp"},
            "unknown key 'shared_storage_path' (allowed: path, load_mode",
        ),
        # Fault injection is test-only: the error says where it went.
        ({"path": p, "fail_load_request_ids": ["a"]}, faulty_store.MODULE_PATH),
    ):
        with pytest.raises(ValueError) as info:
            PrefixStoreConfig.from_extra_config(bad)
        text = str(info.value)
        assert text.startswith("PrefixStoreConnector: ") and message in text, text
        assert "\n" not in text
    # The test double's config takes the fault-injection key (and the store's keys).
    faulty = FaultyPrefixStoreConfig.from_extra_config(
        {"path": p, "chunk_blocks": 2, "fail_load_request_ids": ["a"]}
    )
    assert faulty.fail_load_request_ids == ("a",) and faulty.chunk_blocks == 2
    assert FaultyPrefixStoreConfig.from_extra_config({"path": p}).fail_load_request_ids == ()
    with pytest.raises(ValueError, match="fail_load_request_ids: expected a list, got a string"):
        FaultyPrefixStoreConfig.from_extra_config({"path": p, "fail_load_request_ids": "a"})


def test_stats_aggregate_reduce_roundtrip():
    a = PrefixStoreStats()
    assert a.is_empty()
    a.add(chunks_loaded=2, tokens_loaded=64, bytes_loaded=100)
    b = PrefixStoreConnector.build_kv_connector_stats({"chunks_saved": 1, "bytes_saved": 7})
    assert isinstance(b, PrefixStoreStats) and not b.is_empty()
    a.aggregate(b)
    r = a.reduce()
    assert r["chunks_loaded"] == 2 and r["chunks_saved"] == 1 and r["bytes_saved"] == 7
    rebuilt = PrefixStoreConnector.build_kv_connector_stats(a.to_dict())
    assert rebuilt.reduce() == r
    a.reset()
    assert a.is_empty()
    assert PrefixStoreConnector.build_kv_connector_stats(None).is_empty()


@pytest.mark.engine  # needs the CPU build's attention kernels (absent from the official wheel)
def test_cpu_block_layout_matches_the_cpu_kernel():
    """Decode tiles written by the CPU backend's real KV write op (K transposed, then V)."""
    pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, BS, 32)
    if isa != "vec":
        pytest.skip(f"CPU attention ISA {isa} packs blocks differently")
    num_blocks, heads, hs = 4, 2, 32
    cache = torch.zeros(num_blocks, heads, BS, 2 * hs)
    view = cache.view(num_blocks, heads, 2 * BS, hs)
    key_cache, value_cache = view.chunk(2, dim=2)
    n = 2 * BS
    key, value = torch.randn(n, heads, hs), torch.randn(n, heads, hs)
    slots = torch.tensor([2 * BS + i for i in range(BS)] + [BS + i for i in range(BS)])
    torch.ops._C.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slots,
        _get_attn_isa(torch.float32, BS, hs),
        1.0,
        1.0,
        "auto",
    )
    k, v = cpu_tiles_to_kv(cache[torch.tensor([2, 1])])
    torch.testing.assert_close(k, key)
    torch.testing.assert_close(v, value)


# ------------------------------------------------------------- connector, no engine


class FakeBlocks:
    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def fake_request(req_id: str, tokens: list[int], **kw: Any) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        mm_features=kw.get("mm_features", []),
        lora_request=None,
        cache_salt=kw.get("cache_salt"),
    )


def make_connector(
    tmp_path,
    role: str = "scheduler",
    num_blocks: int = 64,
    cls: type[PrefixStoreConnector] = PrefixStoreConnector,
    **extra: Any,
):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    extra.setdefault("path", str(tmp_path / "store"))
    ktc = KVTransferConfig(
        kv_connector=cls.__name__,
        kv_connector_module_path=cls.__module__,
        kv_role=extra.pop("kv_role", "kv_both"),
        kv_connector_extra_config=extra,
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        model_config=SimpleNamespace(model="fake-model", dtype=torch.float32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return cls(vllm_config, r, SimpleNamespace(num_blocks=num_blocks))


def touch_chunks(conn: PrefixStoreConnector, tokens: list[int], n: int) -> list[str]:
    keys = chunk_keys(tokens, conn.scheduler.chunk_tokens, conn.scheduler.salt)[:n]
    for k in keys:
        open(conn.files.file(k), "wb").close()
    return keys


def sched_output(new=(), cached=None, num_scheduled=None):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    num_scheduled = num_scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def new_req(req_id, tokens, blocks, num_computed):
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=tokens,
        block_ids=(blocks,),
        num_computed_tokens=num_computed,
    )


def test_lookup_is_prefix_aware_and_idempotent(tmp_path):
    conn = make_connector(tmp_path)
    tokens = list(range(1000, 1000 + 200))  # 6 full chunks inside prompt[:-1]
    req = fake_request("r", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    touch_chunks(conn, tokens, 2)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, False)  # idempotent
    assert conn.get_num_new_matched_tokens(req, 32) == (32, False)  # local hit subtracted
    assert conn.get_num_new_matched_tokens(req, 64) == (0, False)
    assert conn.get_num_new_matched_tokens(req, 96) == (0, False)
    # A gap stops the count: chunk 3 stored, chunk 2 not.
    k = chunk_keys(tokens, BS, conn.scheduler.salt)
    open(conn.files.file(k[3]), "wb").close()
    assert conn.get_num_new_matched_tokens(req, 0) == (64, False)
    # Never the last token: a 64-token prompt whose 2 chunks are stored loads 32.
    short = tokens[:64]
    assert conn.get_num_new_matched_tokens(fake_request("s", short), 0) == (32, False)
    # Multimodal requests and other salts are not matched.
    assert conn.get_num_new_matched_tokens(fake_request("m", tokens, mm_features=[1]), 0) == (
        0,
        False,
    )
    assert conn.get_num_new_matched_tokens(fake_request("c", tokens, cache_salt="x"), 0) == (
        0,
        False,
    )
    # Async mode: (n, True) for hits, never (0, True).
    aconn = make_connector(tmp_path, load_mode="async")
    assert aconn.get_num_new_matched_tokens(req, 0) == (64, True)
    assert aconn.get_num_new_matched_tokens(req, 64) == (0, False)
    # A producer-only store does not load.
    assert make_connector(tmp_path, kv_role="kv_producer").get_num_new_matched_tokens(req, 0) == (
        0,
        False,
    )


def test_load_planned_after_local_hit_and_only_for_positive_counts(tmp_path):
    conn = make_connector(tmp_path, chunk_blocks=2)  # 64-token chunks
    tokens = list(range(500, 500 + 300))
    keys = touch_chunks(conn, tokens, 3)  # 192 tokens stored
    req = fake_request("r", tokens)
    blocks = FakeBlocks(list(range(40, 50)))  # 10 blocks of 32 = 320 slots
    # Local hit of 32 tokens (1 block): load tokens [32, 192).
    assert conn.get_num_new_matched_tokens(req, 32) == (160, False)
    conn.update_state_after_alloc(req, blocks, 160)
    meta = conn.build_connector_meta(sched_output())
    assert isinstance(meta, PrefixStoreMetadata) and len(meta.loads) == 1
    load: LoadSpec = meta.loads[0]
    assert load.num_tokens == 160 and not load.is_async
    assert [(c.key, c.first_block, c.block_ids, c.num_tokens) for c in load.chunks] == [
        (keys[0], 1, [41], 32),
        (keys[1], 0, [42, 43], 64),
        (keys[2], 0, [44, 45], 64),
    ]
    # Metadata is per step.
    assert conn.build_connector_meta(sched_output()).loads == []
    # n == 0 records nothing, even with real blocks; a second 0-call is ignored.
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, blocks, 0)
    conn.update_state_after_alloc(req, blocks, 0)
    assert conn.build_connector_meta(sched_output()).loads == []


def test_saves_follow_chunked_prefill_and_skip_stored_chunks(tmp_path):
    conn = make_connector(tmp_path)
    tokens = list(range(2000, 2000 + 150))  # 4 full chunks (the 5th is partial)
    touch_chunks(conn, tokens, 1)  # chunk 0 already stored
    req = fake_request("r", tokens)
    blocks = list(range(10, 15))
    conn.update_state_after_alloc(req, FakeBlocks(blocks), 0)
    # Step 1: chunked prefill computes tokens [0, 70): chunks 0 and 1 complete.
    meta = conn.build_connector_meta(
        sched_output(new=[new_req("r", tokens, blocks, 0)], num_scheduled={"r": 70})
    )
    keys = chunk_keys(tokens, BS, conn.scheduler.salt)
    assert [(s.key, s.block_ids) for s in meta.saves] == [(keys[1], [11])]
    # Step 2: [70, 150): chunks 2 and 3; the partial 5th chunk is never saved.
    from vllm.v1.core.sched.output import CachedRequestData

    cached = CachedRequestData(
        req_ids=["r"],
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None],
        num_computed_tokens=[70],
        num_output_tokens=[0],
    )
    meta = conn.build_connector_meta(sched_output(cached=cached, num_scheduled={"r": 80}))
    assert [(s.key, s.block_ids) for s in meta.saves] == [(keys[2], [12]), (keys[3], [13])]
    # Decode steps save nothing more (generated tokens are not stored).
    cached.num_computed_tokens = [150]
    assert (
        conn.build_connector_meta(sched_output(cached=cached, num_scheduled={"r": 1})).saves == []
    )
    # Two requests with the same prompt in one step save each chunk once.
    conn2 = make_connector(tmp_path, path=str(tmp_path / "s2"))
    for rid, blks in (("a", [1, 2]), ("b", [3, 4])):
        conn2.update_state_after_alloc(fake_request(rid, tokens[:64]), FakeBlocks(blks), 0)
    meta = conn2.build_connector_meta(
        sched_output(
            new=[new_req("a", tokens[:64], [1, 2], 0), new_req("b", tokens[:64], [3, 4], 0)],
            num_scheduled={"a": 64, "b": 64},
        )
    )
    assert [s.block_ids for s in meta.saves] == [[1], [2]]
    # read_only never saves.
    ro = make_connector(tmp_path, path=str(tmp_path / "s3"), read_only=True)
    ro.update_state_after_alloc(req, FakeBlocks(blocks), 0)
    meta = ro.build_connector_meta(
        sched_output(new=[new_req("r", tokens, blocks, 0)], num_scheduled={"r": 150})
    )
    assert meta.saves == []


def test_failed_async_load_is_not_offered_again(tmp_path):
    from vllm.v1.outputs import KVConnectorOutput

    conn = make_connector(tmp_path, load_mode="async")
    tokens = list(range(300, 400))
    touch_chunks(conn, tokens, 2)
    req = fake_request("r", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, True)
    conn.update_connector_output(KVConnectorOutput(finished_recving={"r"}, failed_recving={"r"}))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.request_finished(req, []) == (False, None)
    assert conn.get_num_new_matched_tokens(req, 0) == (64, True)


# ------------------------------------------------------------------- worker side


def _run_step(
    conn: PrefixStoreConnector, meta: PrefixStoreMetadata, caches: dict[str, torch.Tensor]
):
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(SimpleNamespace(no_compile_layers={}))
    for name, kv in caches.items():
        conn.save_kv_layer(name, kv, None)
    conn.wait_for_save()
    res = conn.get_transfer_results(set())
    bad = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    return res, bad


def _caches(num_blocks=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, 2, BS, 64, generator=g)
        for i in range(2)
    }


def test_worker_save_then_load_roundtrip(tmp_path):
    src = _caches(seed=1)
    w = make_connector(tmp_path, role="worker", num_blocks=16, chunk_blocks=2)
    w.register_kv_caches(src)
    save = PrefixStoreMetadata(
        saves=[SaveSpec(key="k0", block_ids=[3, 7], num_tokens=64, req_id="r")]
    )
    _run_step(w, save, src)
    assert store_usage(tmp_path / "store")["files"] == 1
    assert not [n for n in os.listdir(tmp_path / "store") if n.endswith(".tmp")]
    assert w.total_stats.data["chunks_saved"] == 1

    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    w2 = make_connector(tmp_path, role="worker", num_blocks=16, chunk_blocks=2)
    w2.register_kv_caches(dst)
    # Load only the second block of the chunk into block 9 (first block was a local hit).
    load = LoadSpec(
        req_id="r", is_async=True, num_tokens=32,
        chunks=[ChunkLoad(key="k0", first_block=1, block_ids=[9], num_tokens=32)],
    )  # fmt: skip
    res, bad = _run_step(w2, PrefixStoreMetadata(loads=[load]), {})
    assert res.finished_recving == {"r"} and not res.failed_recving and not bad
    for n in src:
        torch.testing.assert_close(dst[n][9], src[n][7])
        assert dst[n][3].abs().sum() == 0
    stats = w2.get_kv_connector_stats()
    assert stats.data["chunks_loaded"] == 1 and stats.data["tokens_loaded"] == 32
    assert w2.get_kv_connector_stats() is None  # interval stats reset

    # A missing chunk fails: sync loads report the blocks, async loads the request.
    missing = LoadSpec(
        req_id="s", is_async=False, num_tokens=64,
        chunks=[
            ChunkLoad(key="k0", first_block=0, block_ids=[1], num_tokens=32),
            ChunkLoad(key="nope", first_block=0, block_ids=[2, 4], num_tokens=32),
        ],
    )  # fmt: skip
    res, bad = _run_step(w2, PrefixStoreMetadata(loads=[missing]), {})
    assert bad == {2, 4} and not res.finished_recving
    missing.is_async = True
    res, bad = _run_step(w2, PrefixStoreMetadata(loads=[missing]), {})
    assert res.finished_recving == {"s"} and res.failed_recving == {"s"} and not bad

    # A chunk written for another cache shape is rejected, not injected.
    w3 = make_connector(tmp_path, role="worker", num_blocks=16, chunk_blocks=2)
    w3.register_kv_caches({n: torch.zeros(16, 4, BS, 64) for n in src})
    res, bad = _run_step(w3, PrefixStoreMetadata(loads=[load]), {})
    assert res.failed_recving == {"r"}


def test_worker_fault_injection_and_eviction(tmp_path):
    src = _caches()
    w = make_connector(
        tmp_path,
        role="worker",
        num_blocks=16,
        cls=faulty_store.FaultyPrefixStoreConnector,
        max_chunks=3,
        fail_load_request_ids=["bad"],
    )
    w.register_kv_caches(src)
    for i in range(5):
        meta = PrefixStoreMetadata(
            saves=[SaveSpec(key=f"k{i}", block_ids=[i], num_tokens=32, req_id="r")]
        )
        _run_step(w, meta, src)
    names = sorted(os.listdir(tmp_path / "store"))
    assert names == [chunk_file_name(f"k{i}") for i in (2, 3, 4)]
    load = LoadSpec(
        req_id="bad-0123abcd", is_async=False, num_tokens=32,
        chunks=[ChunkLoad(key="k4", first_block=0, block_ids=[8], num_tokens=32)],
    )  # fmt: skip
    _res, bad = _run_step(w, PrefixStoreMetadata(loads=[load]), {})
    assert bad == {8} and w.total_stats.data["load_failures"] == 1
    load.req_id = "good-0123abcd"
    _, bad = _run_step(w, PrefixStoreMetadata(loads=[load]), {})
    assert not bad and w.total_stats.data["chunks_loaded"] == 1


def test_guards_and_reset(tmp_path):
    # A load larger than what the store offered is planned against a key that is
    # never stored, so the worker reports it failed instead of loading garbage.
    conn = make_connector(tmp_path)
    tokens = list(range(3000, 3100))
    touch_chunks(conn, tokens, 1)
    req = fake_request("r", tokens)
    assert conn.get_num_new_matched_tokens(req, 0) == (32, False)
    conn.update_state_after_alloc(req, FakeBlocks([5, 6, 7, 8, 9]), 128)
    (load,) = conn.build_connector_meta(sched_output()).loads
    keys = chunk_keys(tokens, BS, conn.scheduler.salt)
    assert [c.key for c in load.chunks] == [*keys, "not-stored"]
    w = make_connector(tmp_path, role="worker", num_blocks=16)
    w.register_kv_caches(_caches())
    _, bad = _run_step(w, PrefixStoreMetadata(loads=[load]), {})
    assert bad == {5, 6, 7, 8}  # the touched chunk-0 file is empty: everything fails
    # reset_cache empties the directory (not for read-only stores).
    assert store_usage(conn.config.path)["files"] == 1
    assert conn.reset_cache() is True
    assert store_usage(conn.config.path)["files"] == 0
    assert make_connector(tmp_path, read_only=True).reset_cache() is False
    # Under several KV cache groups, a group whose blocks are not per token is refused at
    # construction (full-attention and sliding-window groups are stored per group).
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    ktc = KVTransferConfig(
        kv_connector="PrefixStoreConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"path": str(tmp_path / "g")},
    )
    cfg = SimpleNamespace(kv_transfer_config=ktc)
    groups = [
        SimpleNamespace(layer_names=["a"], kv_cache_spec=object.__new__(FullAttentionSpec)),
        SimpleNamespace(layer_names=["m"], kv_cache_spec=object.__new__(MambaSpec)),
    ]
    with pytest.raises(ValueError, match="KV cache group 1 is a MambaSpec"):
        PrefixStoreConnector(
            cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=8, kv_cache_groups=groups)
        )


def test_facade_loads_by_name_and_builds_one_half_per_role(tmp_path):
    """vLLM resolves the class from ``module_path`` (as user configs name it); each role's
    instance holds only its own half, as vLLM calls it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module, cls in (
        ("PrefixStoreConnector", "kvcompose.stores", PrefixStoreConnector),
        (faulty_store.CONNECTOR, faulty_store.MODULE_PATH, faulty_store.FaultyPrefixStoreConnector),
    ):
        ktc = KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config={"path": str(tmp_path)},
        )
        assert KVConnectorFactory.get_connector_class(ktc) is cls
    sched = make_connector(tmp_path)
    assert sched.connector_worker is None and sched.total_stats.is_empty()
    assert sched.get_kv_connector_stats() is None
    with pytest.raises(RuntimeError, match="worker method called"):
        sched.get_block_ids_with_load_errors()
    worker = make_connector(tmp_path, role="worker")
    assert worker.connector_scheduler is None
    with pytest.raises(RuntimeError, match="scheduler method called"):
        worker.get_num_new_matched_tokens(fake_request("r", [1] * 64), 0)


def test_docs_settings_table_is_the_models():
    """docs/stores.md lists the store's settings as their Fields state them."""
    from pathlib import Path

    from kvcompose.config.docs import settings_table

    docs = Path(__file__).resolve().parents[2] / "docs" / "stores.md"
    assert settings_table(PrefixStoreConfig) in docs.read_text(), (
        "docs/stores.md is stale: paste `kvcompose schema --stores` into its Settings section"
    )
