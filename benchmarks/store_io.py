"""The prefix store's load and save throughput against a plain copy of the same bytes.

No engine: the benchmark builds the store's worker half (:class:`PrefixStoreWorker`, the
object the connector delegates to in a worker process) over layer caches shaped like the
built-in benchmark model's under vLLM's CPU attention backend, and drives the same calls the
connector makes in a step:

- ``load``: ``start_load`` with one request's :class:`LoadSpec` (every chunk of the prompt,
  into scattered destination blocks), as ``start_load_kv`` runs it;
- ``save``: ``begin_step``, ``save_layer`` for every layer, ``wait_for_save`` (``save_mode:
  sync``, the default), as ``bind_connector_metadata``, ``save_kv_layer`` and
  ``wait_for_save`` run them; fresh chunk keys each time, deleted after the timing;
- ``copy``: ``dst.copy_(src)`` of two preallocated tensors of the same number of bytes;
- ``read``: the chunk files read with ``readinto`` into one preallocated buffer (what the
  kernel's copy out of the page cache costs alone; a floor for a file-backed load);
- ``write``: the same bytes written from one buffer into as many new files (unbuffered),
  deleted after the timing (a floor for a save: page-cache allocation and the copy).

Default shapes (the built-in benchmark model, ``kvcompose.engine.model.BUILTIN_SHAPE``): 8
layers, 8 KV heads of 64, float32, block size 128, so a layer's cache is
``[num_blocks, 8, 128, 128]`` (K and V side by side in a block) and one token holds 32 KiB;
2,048 tokens are 16 blocks, 64 MiB, stored as 16 chunk files of 4 MiB (``chunk_blocks: 1``).

Each medium (``/dev/shm``: tmpfs; a directory under ``/var/tmp``: a disk file system whose
files were just written or read, so they are in the page cache) runs ``--rounds`` rounds;
a round times every operation ``--reps`` times (its median is the round's value), the
operations' order rotated from round to round. Ratios to ``copy`` are taken within a round;
the table gives their median and range over the rounds. Torch runs on one thread
(``--threads``), so every copy happens in the timed thread and its CPU time is comparable
across operations; the table shows wall-clock and CPU-time rates.

Run: ``.venv/bin/python benchmarks/store_io.py`` (about a minute on 2 cores); results go to
``benchmarks/results/store_io/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.stores.prefix.files import ChunkFiles
from kvcompose.stores.prefix.metadata import ChunkLoad, LoadSpec, PrefixStoreMetadata, SaveSpec
from kvcompose.stores.prefix.worker import PrefixStoreWorker

OPS = ("copy", "load", "save", "read", "write")
HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "store_io"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Setup:
    """One store directory, a worker over it, and the caches it moves blocks between."""

    def __init__(self, path: str, args: argparse.Namespace) -> None:
        self.args = args
        bs = args.block_size
        self.blocks = args.tokens // bs
        self.chunks = self.blocks // args.chunk_blocks
        num_blocks = 2 * self.blocks + 8
        dtype = DTYPES[args.dtype]
        g = torch.Generator().manual_seed(0)
        shape = (num_blocks, args.kv_heads, bs, 2 * args.head_dim)
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g).to(dtype)
            for i in range(args.layers)
        }
        # The prompt's blocks, scattered as vLLM's free-block queue can hand them out:
        # saves read the first half of the cache, loads write the second half.
        rng = random.Random(0)
        self.src_ids = rng.sample(range(self.blocks + 8), self.blocks)
        self.dst_ids = [self.blocks + 8 + i for i in rng.sample(range(self.blocks), self.blocks)]
        cfg = PrefixStoreConfig(path=path, chunk_blocks=args.chunk_blocks)
        self.files = ChunkFiles(path, [""])
        self.worker = PrefixStoreWorker(
            cfg, self.files, kv_cache_config=SimpleNamespace(num_blocks=num_blocks), block_size=bs
        )
        self.worker.register_kv_caches(self.caches)
        self.nbytes = sum(kv[0].numel() * kv.element_size() for kv in self.caches.values())
        self.nbytes *= self.blocks
        # The chunks loads read, written once through the same save path.
        self.keys = [f"load{i:04d}" for i in range(self.chunks)]
        self._save(self.keys)
        self.load_meta = PrefixStoreMetadata(
            loads=[
                LoadSpec(
                    req_id="r",
                    is_async=False,
                    num_tokens=args.tokens,
                    chunks=[
                        ChunkLoad(
                            key=k,
                            first_block=0,
                            block_ids=self.dst_ids[
                                i * args.chunk_blocks : (i + 1) * args.chunk_blocks
                            ],
                            num_tokens=args.chunk_blocks * bs,
                        )
                        for i, k in enumerate(self.keys)
                    ],
                )
            ]
        )
        flat = self.nbytes // 4
        self.copy_src = torch.randn(flat, generator=g)
        self.copy_dst = torch.empty(flat).fill_(1.0)
        # A torch allocation like the caches' (numpy would ask for huge pages for a buffer
        # this large, which the caches do not get, and read faster for it).
        self.read_buf = torch.ones(self.nbytes + 2**20, dtype=torch.uint8).numpy()
        self.check_load()

    def _save(self, keys: list[str]) -> None:
        cb, bs = self.args.chunk_blocks, self.args.block_size
        meta = PrefixStoreMetadata(
            saves=[
                SaveSpec(
                    key=k,
                    block_ids=self.src_ids[i * cb : (i + 1) * cb],
                    num_tokens=cb * bs,
                    req_id="s",
                )
                for i, k in enumerate(keys)
            ]
        )
        self.worker.begin_step(meta)
        for name, kv in self.caches.items():
            self.worker.save_layer(meta, name, kv)
        self.worker.wait_for_save(meta)

    def check_load(self) -> None:
        """A load puts every saved block where the spec says (else the numbers are moot)."""
        for kv in self.caches.values():
            kv[self.dst_ids].zero_()
        self.load()
        for kv in self.caches.values():
            if not torch.equal(kv[self.dst_ids], kv[self.src_ids]):
                raise SystemExit("load did not reproduce the saved blocks")

    # ------------------------------------------------------------ the operations
    # Each returns (wall seconds, this thread's CPU seconds): on a shared machine the CPU
    # time shows the work when the wall clock also counts time spent descheduled.
    def copy(self) -> tuple[float, float]:
        with Timer() as t:
            self.copy_dst.copy_(self.copy_src)
        return t.result

    def load(self) -> tuple[float, float]:
        with Timer() as t:
            self.worker.start_load(self.load_meta, None)  # type: ignore[arg-type]
        if self.worker.block_ids_with_load_errors():
            raise SystemExit("load failed")
        return t.result

    def save(self) -> tuple[float, float]:
        keys = [f"save-{uuid.uuid4().hex[:12]}-{i}" for i in range(self.chunks)]
        with Timer() as t:
            self._save(keys)
        for k in keys:
            os.unlink(self.files.file(k))
        return t.result

    def read(self) -> tuple[float, float]:
        view = memoryview(self.read_buf)
        with Timer() as t:
            off = 0
            for k in self.keys:
                with open(self.files.file(k), "rb", buffering=0) as fh:
                    while n := fh.readinto(view[off:]):
                        off += n
        return t.result

    def write(self) -> tuple[float, float]:
        per_file = self.nbytes // self.chunks
        view = memoryview(self.read_buf)
        paths = [self.files.file(f"write-{uuid.uuid4().hex[:12]}-{i}") for i in range(self.chunks)]
        with Timer() as t:
            for i, path in enumerate(paths):
                with open(path, "wb", buffering=0) as fh:
                    part = view[i * per_file : (i + 1) * per_file]
                    while part.nbytes:
                        part = part[fh.write(part) :]
        for path in paths:
            os.unlink(path)
        return t.result


class Timer:
    """Wall and thread CPU time of a ``with`` block."""

    def __enter__(self) -> Timer:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = (time.perf_counter() - self._wall, time.thread_time() - self._cpu)


def run_medium(root: str, args: argparse.Namespace) -> dict[str, Any]:
    path = tempfile.mkdtemp(prefix="kvcompose-store-io-", dir=root)
    try:
        s = Setup(path, args)
        ops: dict[str, Callable[[], tuple[float, float]]] = {op: getattr(s, op) for op in OPS}
        for op in OPS:  # warm-up: page cache, allocator, first-call costs
            ops[op]()
        rounds = []
        for r in range(args.rounds):
            order = [OPS[(r + i) % len(OPS)] for i in range(len(OPS))]
            rnd = {}
            for op in order:
                reps = [ops[op]() for _ in range(args.reps)]
                rnd[op] = {
                    "seconds": statistics.median(w for w, _ in reps),
                    "cpu_seconds": statistics.median(c for _, c in reps),
                    "reps": reps,
                }
            rounds.append({"order": order, "ops": rnd})
        return {"path_root": root, "bytes": s.nbytes, "files": s.chunks, "rounds": rounds}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def summarize(medium: dict[str, Any]) -> dict[str, dict[str, float]]:
    nbytes = medium["bytes"]
    out = {}
    for op in OPS:
        gbps = np.array([nbytes / r["ops"][op]["seconds"] / 1e9 for r in medium["rounds"]])
        ratio = np.array(
            [r["ops"]["copy"]["seconds"] / r["ops"][op]["seconds"] for r in medium["rounds"]]
        )
        ms = np.array([r["ops"][op]["seconds"] * 1e3 for r in medium["rounds"]])
        cpu_gbps = np.array([nbytes / r["ops"][op]["cpu_seconds"] / 1e9 for r in medium["rounds"]])
        cpu_ratio = np.array(
            [
                r["ops"]["copy"]["cpu_seconds"] / r["ops"][op]["cpu_seconds"]
                for r in medium["rounds"]
            ]
        )
        out[op] = {
            "ms_median": float(np.median(ms)),
            "gbps_median": float(np.median(gbps)),
            "gbps_min": float(gbps.min()),
            "gbps_max": float(gbps.max()),
            "gbps_p25": float(np.percentile(gbps, 25)),
            "gbps_p75": float(np.percentile(gbps, 75)),
            "vs_copy_median": float(np.median(ratio)),
            "vs_copy_min": float(ratio.min()),
            "vs_copy_max": float(ratio.max()),
            "cpu_gbps_median": float(np.median(cpu_gbps)),
            "cpu_vs_copy_median": float(np.median(cpu_ratio)),
        }
    return out


def report(result: dict[str, Any]) -> str:
    p = result["params"]
    mib = result["media"][next(iter(result["media"]))]["bytes"] / 2**20
    lines = [
        f"Store I/O: {p['tokens']:,} tokens = {mib:.0f} MiB of KV ({p['layers']} layers, "
        f"{p['kv_heads']} KV heads of {p['head_dim']}, {p['dtype']}, block size "
        f"{p['block_size']}, chunk_blocks {p['chunk_blocks']}); {p['rounds']} rounds x "
        f"{p['reps']} reps, order rotated. Label: {result['label']}.",
        "GB/s are bytes moved per wall-clock second; ratios to copy are taken within each "
        "round. CPU GB/s: bytes per second of the thread's CPU time (user + system), which "
        "leaves out time the thread waited for a core on a shared machine.",
        "",
        "| medium | op | ms (median) | GB/s median | GB/s p25-p75 | GB/s min-max "
        "| vs copy, median (range) | CPU GB/s | CPU vs copy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for medium, summary in result["summary"].items():
        for op in OPS:
            v = summary[op]
            lines.append(
                f"| {medium} | {op} | {v['ms_median']:.1f} | {v['gbps_median']:.2f} | "
                f"{v['gbps_p25']:.2f}-{v['gbps_p75']:.2f} | "
                f"{v['gbps_min']:.2f}-{v['gbps_max']:.2f} "
                f"| {v['vs_copy_median']:.2f}x ({v['vs_copy_min']:.2f}-{v['vs_copy_max']:.2f}) "
                f"| {v['cpu_gbps_median']:.2f} | {v['cpu_vs_copy_median']:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--chunk-blocks", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--disk", default="/var/tmp")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--label", default="", help="a name for this run, kept in the results")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if args.tokens % (args.block_size * args.chunk_blocks):
        raise SystemExit("--tokens must be a multiple of block size x chunk blocks")
    torch.set_num_threads(args.threads)
    media = {}
    for name, root in (("tmpfs", args.tmpfs), ("disk (page cache)", args.disk)):
        media[name] = run_medium(root, args)
        s = summarize(media[name])
        print(
            f"{name}: " + ", ".join(f"{op} {s[op]['gbps_median']:.2f} GB/s" for op in OPS),
            flush=True,
        )
    params = {k: v for k, v in vars(args).items() if k not in ("out", "no_write", "label")}
    result = {
        "label": args.label or "unlabelled",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "params": params,
        "summary": {name: summarize(m) for name, m in media.items()},
        "media": media,
    }
    table = report(result)
    print(table)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "results.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
