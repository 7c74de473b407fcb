"""Writing a chunk file in the safetensors format with the GIL released for the bytes.

``safetensors.torch.save_file`` serializes under the GIL. From the background writer that
stalls the engine's own thread, which needs the GIL between every small op of a forward
(measured on the Mooncake replay: decode steps went from ~60 ms to ~700 ms). This writer
builds the small JSON header in Python and hands each tensor's bytes, zero-copy, to an
unbuffered ``FileIO.write``, which releases the GIL during the system call. The file is an
ordinary safetensors file (``safetensors.torch.load_file`` reads it); a dtype not in
:data:`DTYPES` falls back to ``save_file``.
"""

from __future__ import annotations

import json
import struct

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


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` (CPU) and ``metadata`` to ``path`` as a safetensors file."""
    if any(t.dtype not in DTYPES for t in tensors.values()):
        import safetensors.torch

        safetensors.torch.save_file(tensors, path, metadata=metadata)
        return
    header: dict[str, object] = {}
    buffers = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        buffers.append(t.reshape(-1).view(torch.uint8).numpy())
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
