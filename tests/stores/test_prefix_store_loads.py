"""The store's worker-side loads (``kvcompose.stores.prefix.loads``) on real files: the
direct reads into cache blocks, the staging path for blocks that are not contiguous inside,
the ``safetensors`` fallback, files that do not fit, and the emulated slow tier.

The worker half runs for real over layer caches made by the test (no engine)."""

from __future__ import annotations

import os
import struct
import time
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch

from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.stores.prefix.files import ChunkFiles
from kvcompose.stores.prefix.metadata import ChunkLoad, LoadSpec, PrefixStoreMetadata, SaveSpec
from kvcompose.stores.prefix.safetensors_io import FormatError, read_header
from kvcompose.stores.prefix.worker import PrefixStoreWorker

BS = 32
NUM_BLOCKS = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def make_worker(path, caches: dict[str, torch.Tensor], **cfg) -> PrefixStoreWorker:
    config = PrefixStoreConfig.from_extra_config({"path": str(path), **cfg})
    w = PrefixStoreWorker(
        config,
        ChunkFiles(str(path), [""]),
        kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS),
        block_size=BS,
    )
    w.register_kv_caches(caches)
    return w


def caches(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(NUM_BLOCKS, 2, BS, 64, generator=g) * 100).to(dtype) for n in LAYERS}


def save(w: PrefixStoreWorker, key: str, block_ids: list[int], src: dict) -> None:
    meta = PrefixStoreMetadata(
        saves=[SaveSpec(key=key, block_ids=block_ids, num_tokens=BS * len(block_ids), req_id="s")]
    )
    w.begin_step(meta)
    for name, kv in src.items():
        w.save_layer(meta, name, kv)
    w.wait_for_save(meta)


def load(w: PrefixStoreWorker, key: str, block_ids: list[int], first_block: int = 0) -> bool:
    spec = LoadSpec(
        req_id="r",
        is_async=False,
        num_tokens=BS * len(block_ids),
        chunks=[ChunkLoad(key, first_block, block_ids, BS * len(block_ids))],
    )
    return w.load(spec, w._kv_caches)


def test_a_file_written_by_the_safetensors_library_loads_bit_for_bit(tmp_path):
    """The format is the library's both ways: files written before the direct reader (by
    ``safetensors.torch.save_file``) load, and the store's files read with the library."""
    src = caches(seed=1)
    files = ChunkFiles(str(tmp_path), [""])
    tiles = {n: kv[[4, 9, 2]].contiguous() for n, kv in src.items()}
    safetensors.torch.save_file(tiles, files.file("lib"), metadata={"key": "lib"})
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    w = make_worker(tmp_path, dst)
    assert load(w, "lib", [11, 0], first_block=1)
    for n in LAYERS:
        assert torch.equal(dst[n][11], src[n][9]) and torch.equal(dst[n][0], src[n][2])
        assert dst[n][[1, 2, 3, 4, 9]].abs().sum() == 0
    assert w.total_stats.data["bytes_loaded"] == 2 * len(LAYERS) * dst[LAYERS[0]][0].nbytes

    save(make_worker(tmp_path, src), "ours", [5, 6], src)
    back = safetensors.torch.load_file(files.file("ours"))
    for n in LAYERS:
        assert torch.equal(back[n], src[n][[5, 6]])


def heads_outside_blocks(src: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Caches laid out ``[H, B, N, C]`` and viewed as ``[B, H, N, C]``: no block is one
    contiguous run (as vLLM's ``LHBNC`` layout), so neither direct reads nor in-place
    writes apply."""
    out = {n: torch.zeros(2, NUM_BLOCKS, BS, 64).permute(1, 0, 2, 3) for n in LAYERS}
    for n, kv in (src or {}).items():
        out[n].copy_(kv)
    assert not out[LAYERS[0]][0].is_contiguous()
    return out


def test_more_blocks_than_one_preadv_takes_are_read_in_batches(tmp_path, monkeypatch):
    from kvcompose.stores.prefix import loads

    src = caches(seed=8)
    save(make_worker(tmp_path, src), "k", [3, 7, 8], src)
    monkeypatch.setattr(loads, "_IOV_MAX", 2)
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    assert load(make_worker(tmp_path, dst), "k", [0, 5, 6])
    for n in LAYERS:
        assert torch.equal(dst[n][[0, 5, 6]], src[n][[3, 7, 8]])


def test_blocks_not_contiguous_inside_go_through_a_copy(tmp_path):
    """Loads into such a cache go through a staging tensor and saves from it through
    ``index_select``; the bytes are the same both ways."""
    src = caches(seed=2)
    save(make_worker(tmp_path, src), "k", [3, 7, 8], src)
    dst = heads_outside_blocks()
    w = make_worker(tmp_path, dst)
    assert load(w, "k", [15, 1], first_block=1)
    for n in LAYERS:
        assert torch.equal(dst[n][15], src[n][7]) and torch.equal(dst[n][1], src[n][8])
    strided = heads_outside_blocks(src)
    save(make_worker(tmp_path, strided), "s", [5, 2], strided)
    back = safetensors.torch.load_file(ChunkFiles(str(tmp_path), [""]).file("s"))
    for n in LAYERS:
        assert torch.equal(back[n], src[n][[5, 2]])


def test_a_sync_save_from_host_caches_writes_the_blocks_in_place(tmp_path):
    """Host caches are not copied out per layer (``BlockRun``: the file is written from the
    blocks in ``wait_for_save``); caches whose blocks are not contiguous are."""
    from kvcompose.stores.prefix.safetensors_io import BlockRun

    for src, in_place in ((caches(seed=7), True), (heads_outside_blocks(caches(seed=7)), False)):
        w = make_worker(tmp_path / str(in_place), src)
        meta = PrefixStoreMetadata(
            saves=[SaveSpec(key="k", block_ids=[6, 1], num_tokens=2 * BS, req_id="s")]
        )
        w.begin_step(meta)
        for name, kv in src.items():
            w.save_layer(meta, name, kv)
        held = w.saves._save_buf["k"][LAYERS[0]]
        assert isinstance(held, BlockRun) is in_place
        w.wait_for_save(meta)
        back = safetensors.torch.load_file(w.files.file("k"))
        for n in LAYERS:
            assert torch.equal(back[n], src[n][[6, 1]])


def test_a_dtype_the_direct_reader_lacks_goes_through_safetensors(tmp_path):
    """The writer hands dtypes it has no code for to ``save_file``; the reader hands them
    back to ``load_file``."""
    src = {n: (kv.abs() * 10).to(torch.uint16) for n, kv in caches(seed=3).items()}
    save(make_worker(tmp_path, src), "u16", [2, 5], src)
    dst = {n: torch.zeros_like(kv) for n, kv in src.items()}
    assert load(make_worker(tmp_path, dst), "u16", [9, 10])
    for n in LAYERS:
        assert torch.equal(dst[n][[9, 10]], src[n][[2, 5]])


def _corrupt(path: str, how: str) -> None:
    with open(path, "rb") as fh:
        raw = fh.read()
    (length,) = struct.unpack("<Q", raw[:8])
    if how == "truncated":
        raw = raw[:-100]
    elif how == "header length":
        raw = struct.pack("<Q", len(raw) * 2) + raw[8:]
    elif how == "header json":
        raw = raw[:8] + b"{" * length + raw[8 + length :]
    elif how == "empty":
        raw = b""
    with open(path, "wb") as fh:
        fh.write(raw)


@pytest.mark.parametrize("how", ["truncated", "header length", "header json", "empty"])
def test_a_damaged_file_fails_the_load_and_leaves_the_cache_untouched(tmp_path, how):
    src = caches(seed=4)
    save(make_worker(tmp_path, src), "k", [3, 4], src)
    _corrupt(ChunkFiles(str(tmp_path), [""]).file("k"), how)
    dst = {n: torch.full_like(kv, 7.0) for n, kv in src.items()}
    w = make_worker(tmp_path, dst)
    assert not load(w, "k", [0, 1])
    assert w.block_ids_with_load_errors() == {0, 1}
    assert w.total_stats.data["load_failures"] == 1
    assert all(bool((kv == 7.0).all()) for kv in dst.values())


def test_a_file_for_another_cache_shape_or_dtype_is_rejected(tmp_path):
    src = caches(seed=5)
    save(make_worker(tmp_path, src), "k", [3], src)
    for dst in (
        {n: torch.zeros(NUM_BLOCKS, 4, BS, 64) for n in LAYERS},  # other heads
        {n: torch.zeros(NUM_BLOCKS, 2, BS, 64, dtype=torch.float16) for n in LAYERS},
        {"model.layers.9.self_attn.attn": torch.zeros(NUM_BLOCKS, 2, BS, 64)},  # other layer
    ):
        w = make_worker(tmp_path, dst)
        assert not load(w, "k", [0])
        assert all(kv.abs().sum() == 0 for kv in dst.values())
    # More blocks than the file holds.
    assert not load(make_worker(tmp_path, caches()), "k", [0, 1])


def test_read_header_checks_every_tensor_against_the_file(tmp_path):
    path = str(tmp_path / "x.safetensors")
    safetensors.torch.save_file({"a": torch.zeros(2, 3), "b": torch.ones(4)}, path, {"m": "1"})
    fd = os.open(path, os.O_RDONLY)
    try:
        tensors, metadata = read_header(fd)
    finally:
        os.close(fd)
    assert metadata == {"m": "1"}
    assert tensors["a"].shape == (2, 3) and tensors["a"].dtype == torch.float32
    assert tensors["a"].nbytes == 24 and tensors["b"].nbytes == 16
    with open(path, "rb+") as fh:  # "b" now claims bytes past the end of the file
        raw = fh.read()
        fh.seek(0)
        fh.write(raw.replace(b'"shape":[4]', b'"shape":[8]'))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(FormatError, match="tensor b"):
            read_header(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- emulated slow tier


def test_emulate_read_makes_a_load_take_its_latency_and_bandwidth(tmp_path):
    src = caches(seed=6)
    save(make_worker(tmp_path, src), "k", [3, 4], src)
    w = make_worker(tmp_path, caches(), emulate_read={"latency_ms": 200})
    t0 = time.perf_counter()
    assert load(w, "k", [0, 1])
    assert time.perf_counter() - t0 >= 0.2
    assert w.total_stats.data["emulated_wait_s"] > 0
    assert w.total_stats.data["load_time_s"] >= 0.2
    # Bandwidth: 2 blocks x 2 layers x 16 KiB = 64 KiB at 0.0005 GB/s (500 KB/s) >= 0.13 s.
    nbytes = 2 * len(LAYERS) * src[LAYERS[0]][0].nbytes
    w = make_worker(tmp_path, caches(), emulate_read={"gbps": 0.0005})
    t0 = time.perf_counter()
    assert load(w, "k", [0, 1])
    assert time.perf_counter() - t0 >= nbytes / 0.0005e9
    # Off by default: nothing slept.
    w = make_worker(tmp_path, caches())
    assert load(w, "k", [0, 1]) and w.total_stats.data["emulated_wait_s"] == 0


def test_emulate_read_config_is_checked(tmp_path):
    cfg = PrefixStoreConfig.from_extra_config(
        {"path": str(tmp_path), "emulate_read": {"latency_ms": 5, "gbps": 2}}
    )
    assert cfg.emulate_read is not None
    assert cfg.emulate_read.min_seconds(4 * 10**9) == pytest.approx(2.005)
    for bad, message in (
        ({"latency_ms": -1}, "emulate_read.latency_ms: must be >= 0.0, got -1"),
        ({"gbps": 0}, "emulate_read.gbps: must be > 0.0, got 0"),
        ({"latency_ms": "5"}, "emulate_read.latency_ms: expected a number, got a string ('5')"),
        ({"lat": 5}, "emulate_read.lat: unknown key 'lat' (allowed: latency_ms, gbps)"),
        (5, "emulate_read: expected a mapping, got an integer (5)"),
    ):
        with pytest.raises(ValueError) as info:
            PrefixStoreConfig.from_extra_config({"path": str(tmp_path), "emulate_read": bad})
        assert str(info.value) == f"PrefixStoreConnector: {message}"
