"""Writing and reading chunk files in the safetensors format, without the library's copies.

Writing: the bytes go out with the GIL released.

``safetensors.torch.save_file`` serializes under the GIL. From the background writer that
stalls the engine's own thread, which needs the GIL between every small op of a forward
(measured on the Mooncake replay: decode steps went from ~60 ms to ~700 ms). This writer
builds the small JSON header in Python and hands each tensor's bytes, zero-copy, to an
unbuffered ``FileIO.write``, which releases the GIL during the system call. The file is an
ordinary safetensors file (``safetensors.torch.load_file`` reads it); a dtype not in
:data:`DTYPES` falls back to ``save_file``.

Reading: :func:`read_header` parses the header only (8-byte little-endian length, JSON) and
checks every tensor's entry against the file's size, so the caller can read each tensor's
bytes straight to where they belong (:mod:`kvcompose.stores.prefix.loads`).
``safetensors.torch.load_file`` maps the file and hands out tensors over the mapping, and
copying from those into the KV cache page-faulted its way through the file: the copy ran at
less than half the rate of a plain memory copy (``benchmarks/store_io.py``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: torch dtype -> safetensors dtype code (the codes ``safetensors.torch`` reads).
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

#: safetensors dtype code -> torch dtype.
CODES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPES.items()}
#: A header longer than this is not one of ours (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 2**20


class FormatError(ValueError):
    """A file that is not a readable safetensors file (truncated, foreign, corrupt)."""


class UnsupportedDtype(FormatError):
    """A tensor of a dtype :data:`CODES` lacks (the writer's ``save_file`` fallback)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its dtype, shape and absolute byte range."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(fd: int) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    """The tensors and metadata of the safetensors file open as ``fd``; raises
    :class:`FormatError` unless every tensor's bytes lie inside the file and match its
    dtype and shape."""
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise FormatError(f"{size} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise FormatError(f"header length {length} does not fit a file of {size} bytes")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    tensors: dict[str, StoredTensor] = {}
    for name, entry in header.items():
        try:
            code, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"tensor {name}: malformed entry {entry!r}") from None
        dtype = CODES.get(code)
        if dtype is None:
            raise UnsupportedDtype(f"tensor {name}: dtype {code!r} is not supported")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= start <= end or end - start != numel * dtype.itemsize or base + end > size:
            raise FormatError(
                f"tensor {name}: bytes [{start}, {end}) do not hold {list(shape)}/{code} "
                f"inside a file of {size} bytes"
            )
        tensors[name] = StoredTensor(dtype, shape, base + start, base + end)
    return tensors, metadata


def host_blocks(cache: torch.Tensor) -> np.ndarray | None:
    """``cache`` (blocks at dim 0) as a numpy byte array over the same memory, when every
    block is one contiguous run of host memory (so it can be read into or written from
    directly); None otherwise (device memory, heads outside blocks)."""
    if cache.device.type != "cpu" or cache.dim() < 2 or cache.requires_grad:
        return None
    if not cache[0].is_contiguous():
        return None
    try:
        return cache.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # strides a byte view cannot express
        return None


@dataclass(frozen=True)
class BlockRun:
    """A tensor to write given as its blocks along dim 0, each one contiguous run of host
    memory: KV-cache blocks written where they are, not gathered into a tensor first."""

    dtype: torch.dtype
    #: ``(len(blocks), *block_shape)``.
    shape: tuple[int, ...]
    blocks: Sequence[np.ndarray]

    @classmethod
    def of(cls, cache: torch.Tensor, block_ids: Sequence[int]) -> BlockRun | None:
        """``cache[block_ids]`` as a run, or None when :func:`host_blocks` cannot view
        ``cache`` or its dtype has no code here."""
        if cache.dtype not in DTYPES:
            return None
        blocks = host_blocks(cache)
        if blocks is None:
            return None
        shape = (len(block_ids), *cache.shape[1:])
        return cls(cache.dtype, tuple(shape), [blocks[b] for b in block_ids])

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor | BlockRun], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` (CPU tensors or :class:`BlockRun`) and ``metadata`` to ``path`` as
    a safetensors file."""
    if any(t.dtype not in DTYPES for t in tensors.values()):
        import safetensors.torch

        assert all(isinstance(t, torch.Tensor) for t in tensors.values())
        safetensors.torch.save_file(tensors, path, metadata=metadata)  # type: ignore[arg-type]
        return
    header: dict[str, object] = {}
    buffers: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if isinstance(t, BlockRun):
            shape, nbytes = list(t.shape), t.nbytes
            buffers.extend(t.blocks)
        else:
            t = t.detach().contiguous()
            shape, nbytes = list(t.shape), t.numel() * t.element_size()
            buffers.append(t.reshape(-1).view(torch.uint8).numpy())
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb", buffering=0) as fh:
        _write_all(fh, struct.pack("<Q", len(raw)) + raw)
        for buf in buffers:
            _write_all(fh, memoryview(buf).cast("B"))


def _write_all(fh, data) -> None:  # type: ignore[no-untyped-def]
    view = memoryview(data)
    while view.nbytes:
        n = fh.write(view)
        view = view[n:]
