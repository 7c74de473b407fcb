"""Copying a stored chunk's blocks into the paged KV cache, from its file or from the held
blocks of a write that is still queued.

From a file, each layer's blocks are read with ``preadv`` straight into the destination
blocks' memory: one copy, by the kernel, out of the page cache. The earlier path
(``safetensors.torch.load_file``, tensors over a memory mapping, then ``index_copy_`` into
the cache) copied the same bytes while page-faulting through the mapping, at half a plain
memory copy's rate or less; ``benchmarks/store_io.py`` measures loads against such a copy.
A destination that is not host memory, or whose blocks are not contiguous inside (a layout
with heads outside blocks), is read into a staging tensor and copied with ``index_copy_``.

Every layer of the file is checked against the cache (dtype, block shape, enough blocks)
from the header before any byte is copied, so a file written for another model or layout
leaves the cache untouched. A file that shrinks while it is read (another process
truncating it; eviction unlinks, which does not) fails with the blocks read so far
written, which is harmless: a failed load reports its blocks for recomputation.
The file format is the one the store has always written; a file whose dtype the direct
reader does not know is read through ``safetensors`` as before. Under several KV cache
groups each layer receives its own group's part of a chunk (``ChunkLoad.for_group``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcompose.stores.prefix.safetensors_io import (
    FormatError,
    StoredTensor,
    UnsupportedDtype,
    host_blocks,
    read_header,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvcompose.stores.prefix.groups import KVGroups
    from kvcompose.stores.prefix.metadata import ChunkLoad
    from kvcompose.stores.prefix.writer import WriteJob


def _iov_max() -> int:
    """Buffers one ``preadv`` takes (1024 on Linux; POSIX guarantees 16)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        n = -1
    return n if n > 0 else 16


_IOV_MAX = _iov_max()


@dataclass
class LoadProgress:
    """How far one request's load got; ``failed_from`` is the first chunk not loaded."""

    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0
    files: list[str] = field(default_factory=list)
    failed_from: int | None = None
    #: Several KV cache groups: ``bytes_loaded_group<i>`` -> bytes.
    by_group: dict[str, int] = field(default_factory=dict)


@dataclass
class BlockTarget:
    """One layer's cache (blocks at dim 0) as a load's destination."""

    tensor: torch.Tensor
    #: The cache's bytes as a numpy array, blocks at dim 0, when every block is one
    #: contiguous run of host memory (direct reads); None otherwise (staging copy).
    blocks: np.ndarray | None

    @classmethod
    def of(cls, dst: torch.Tensor) -> BlockTarget:
        return cls(dst, host_blocks(dst))


def block_targets(dsts: dict[str, torch.Tensor]) -> dict[str, BlockTarget]:
    """Layer name -> :class:`BlockTarget`, built once per load."""
    return {name: BlockTarget.of(dst) for name, dst in dsts.items()}


def read_chunk(
    path: str,
    chunk: ChunkLoad,
    targets: dict[str, BlockTarget],
    groups: KVGroups | None = None,
) -> int:
    """Copy blocks ``chunk.first_block, ...`` of every layer in the file at ``path`` into
    ``targets`` (layer name -> cache with blocks at dim 0) at ``chunk.block_ids`` (each
    layer its group's part, with ``groups``); returns the bytes copied. Raises ``OSError``
    or ``ValueError`` when the file does not fit."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            stored, _ = read_header(fd)
        except UnsupportedDtype:
            dsts = {name: t.tensor for name, t in targets.items()}
            return _read_with_safetensors(path, chunk, dsts, groups)
        plan = []
        for name, target in targets.items():
            part = _part(chunk, name, groups)
            plan.append((target, _fit(name, stored.get(name), target.tensor, part), part))
        return sum(_read_blocks(fd, target, src, part) for target, src, part in plan)
    finally:
        os.close(fd)


def _part(chunk: ChunkLoad, layer: str, groups: KVGroups | None) -> ChunkLoad:
    """What one layer receives of ``chunk``."""
    return chunk if groups is None else chunk.for_group(groups.group_of(layer))


def _fit(name: str, src: StoredTensor | None, dst: torch.Tensor, chunk: ChunkLoad) -> StoredTensor:
    """``src`` when it holds the chunk's blocks for ``dst``; raises ``ValueError``."""
    if src is None:
        raise ValueError(f"layer {name}: not in the file")
    if (
        src.dtype != dst.dtype
        or src.shape[1:] != tuple(dst.shape[1:])
        or src.shape[0] < chunk.first_block + len(chunk.block_ids)
    ):
        raise ValueError(
            f"layer {name}: stored {src.shape}/{src.dtype} does not fit cache blocks "
            f"{tuple(dst.shape[1:])}/{dst.dtype}"
        )
    return src


def _read_blocks(fd: int, target: BlockTarget, src: StoredTensor, chunk: ChunkLoad) -> int:
    n = len(chunk.block_ids)
    if n == 0:
        return 0
    per_block = src.nbytes // src.shape[0]
    offset = src.start + chunk.first_block * per_block
    if target.blocks is not None:
        blocks = target.blocks
        views = [blocks[b] for b in chunk.block_ids]
        for i in range(0, n, _IOV_MAX):
            batch = views[i : i + _IOV_MAX]
            _preadv_exactly(fd, batch, offset + i * per_block, len(batch) * per_block)
        return n * per_block
    dst = target.tensor
    staging = torch.empty(n * per_block, dtype=torch.uint8)
    _preadv_exactly(fd, [staging.numpy()], offset, n * per_block)
    _put_blocks(dst, chunk.block_ids, staging.view(dst.dtype).view(n, *dst.shape[1:]))
    return n * per_block


def _put_blocks(dst: torch.Tensor, block_ids: list[int], tiles: torch.Tensor) -> None:
    """``dst[block_ids] = tiles``, as bytes where the layout allows (``index_copy_`` has
    no kernel for some dtypes, e.g. ``uint16``; bytes are bytes)."""
    if dst.dim() > 1 and dst.stride(-1) == 1 and tiles.is_contiguous():
        dst, tiles = dst.view(torch.uint8), tiles.view(torch.uint8)
    idx = torch.tensor(block_ids, dtype=torch.long, device=dst.device)
    dst.index_copy_(0, idx, tiles.to(dst.device))


def _preadv_exactly(fd: int, buffers: list[np.ndarray], offset: int, nbytes: int) -> None:
    got = os.preadv(fd, buffers, offset)
    if got != nbytes:
        # Regular files return short only at the end of the file: it shrank after the
        # header was checked.
        raise FormatError(f"read {got} of {nbytes} bytes at offset {offset}")


def _read_with_safetensors(
    path: str, chunk: ChunkLoad, dsts: dict[str, torch.Tensor], groups: KVGroups | None
) -> int:
    """A file with a dtype :func:`read_header` does not map, read by the library."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(path)
    plan = []
    for name, dst in dsts.items():
        part = _part(chunk, name, groups)
        n = len(part.block_ids)
        src = tensors.get(name)
        stored = None
        if src is not None:
            stored = StoredTensor(src.dtype, tuple(src.shape), 0, src.numel() * src.element_size())
        _fit(name, stored, dst, part)
        assert src is not None
        plan.append((dst, part.block_ids, src[part.first_block : part.first_block + n]))
    nbytes = 0
    for dst, block_ids, tiles in plan:
        _put_blocks(dst, block_ids, tiles.contiguous())
        nbytes += tiles.numel() * tiles.element_size()
    return nbytes


def copy_from_job(
    chunk: ChunkLoad,
    job: WriteJob,
    dsts: dict[str, torch.Tensor],
    by_block: Callable[[torch.Tensor], torch.Tensor],
    groups: KVGroups | None = None,
) -> int:
    """Copy a queued write's held source blocks into ``dsts`` (vLLM frees them only after
    the write, and this step's forward does not touch them; a windowed group's blocks were
    copied when the write was queued); returns the bytes copied."""
    if set(dsts) - set(job.caches):
        raise ValueError(f"queued chunk {chunk.key} does not cover the load")
    nbytes = 0
    for name, dst in dsts.items():
        part = _part(chunk, name, groups)
        n = len(part.block_ids)
        if n == 0:
            continue
        src, src_ids = job.source(name, groups)
        src_ids = src_ids[part.first_block : part.first_block + n]
        if len(src_ids) < n:
            raise ValueError(f"queued chunk {chunk.key} does not cover the load")
        src = by_block(src) if name not in job.copies else src
        src_idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
        tiles = src.index_select(0, src_idx)
        _put_blocks(dst, part.block_ids, tiles)
        nbytes += tiles.numel() * tiles.element_size()
    return nbytes
