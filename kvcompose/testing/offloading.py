"""A CPU worker for vLLM's ``OffloadingConnector``: a test double for the CUDA/XPU one.

vLLM's CPU build cannot start ``OffloadingConnector``: ``CPUOffloadingSpec.get_worker``
(``vllm/v1/kv_offload/cpu/spec.py``) raises on platforms other than CUDA and XPU. The
connector loads an out-of-tree spec through its extra config (``spec_name`` and
``spec_module_path``, read by ``OffloadingSpecFactory.get_spec_cls``), so this module gives
it ``CPUCopyOffloadingSpec``: vLLM's ``CPUOffloadingSpec`` (its manager, chunk sizing and
``store_threshold``) with a worker that copies blocks by tensor indexing instead of CUDA
streams. Everything else stays vLLM's own: the connector, its scheduler side
(``OffloadingConnectorScheduler``), ``CPUOffloadingManager`` and its worker side
(``OffloadingConnectorWorker``, which builds the ``CanonicalKVCaches`` this worker copies
from and to).

``CPUCopyOffloadingWorker`` imitates ``CPUOffloadingWorker`` (``cpu/gpu_worker.py``) with
one chunk per block (``blocks_per_chunk`` 1): one host tensor per canonical KV tensor, one
row per CPU chunk; a transfer walks the groups in order (``GPULoadStoreSpec.group_sizes``)
and copies each group's blocks for every layer reference of the group
(``CanonicalKVCaches.group_data_refs``), as ``SingleDirectionOffloadingHandler.
transfer_async`` does. Transfers complete at once; ``get_finished`` reports them, as the
real worker reports finished CUDA events.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

SPEC_NAME = "CPUCopyOffloadingSpec"
SPEC_MODULE_PATH = "kvcompose.testing.offloading"


def offloading_leaf(
    name: str,
    *,
    cpu_bytes: int = 1 << 24,
    extra_config: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A leaf running vLLM's ``OffloadingConnector`` with this module's CPU worker
    (``cpu_bytes``: its host cache's size, vLLM's ``cpu_bytes_to_use``)."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "OffloadingConnector",
        "extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE_PATH,
            "cpu_bytes_to_use": cpu_bytes,
            **(extra_config or {}),
        },
        **fields,
    }


class CPUCopyOffloadingWorker(OffloadingWorker):
    """Copies blocks between the engine's KV cache tensors and host tensors, synchronously."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        if blocks_per_chunk != 1:
            raise ValueError("the CPU copy worker moves one block per chunk (blocks_per_chunk 1)")
        self.refs = kv_caches.group_data_refs
        #: The engine's KV cache, one ``(num_blocks, page bytes)`` int8 view per tensor.
        self.device = [t.tensor for t in kv_caches.tensors]
        #: The host cache: one row per CPU chunk, per canonical tensor.
        self.host = [
            torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        gpu_ids, cpu_ids = gpu.block_ids, cpu.block_ids
        offset = nbytes = 0
        for group, size in enumerate(gpu.group_sizes):
            rows = slice(offset, offset + size)
            src = torch.from_numpy(np.asarray(gpu_ids[rows], dtype=np.int64))
            dst = torch.from_numpy(np.asarray(cpu_ids[rows], dtype=np.int64))
            for ref in self.refs[group]:
                device, host = self.device[ref.tensor_idx], self.host[ref.tensor_idx]
                n = ref.page_size_bytes
                if store:
                    host[dst, :n] = device[src, :n]
                else:
                    device[src, :n] = host[dst, :n]
                nbytes += size * n
            offset += size
        assert offset == len(gpu_ids) == len(cpu_ids)
        if store:
            self.blocks_stored += offset
        else:
            self.blocks_loaded += offset
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - started))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, **_: Any
    ) -> bool:
        # (vLLM 0.33 adds ``expedited``: a load waited on within the step; all are here.)
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer has completed when it is submitted

    def perturb(self, scale: float, seed: int = 0) -> None:
        """Add noise to every stored block (read as float32): the negative control."""
        gen = torch.Generator().manual_seed(seed)
        for host in self.host:
            values = host.view(torch.float32)
            values.add_(torch.randn(values.shape, generator=gen) * scale)


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker runs on CPU (see the module's docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CPUCopyOffloadingWorker(  # type: ignore[assignment]
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        assert self._worker is not None
        return self._worker
