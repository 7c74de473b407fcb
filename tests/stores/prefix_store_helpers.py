"""Engine helpers for the PrefixStoreConnector engine tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvcompose.engine.llm import generate_by_id
from kvcompose.engine.probe import scheduler
from kvcompose.testing.real_engine import make_llm

#: The CPU attention backend needs block sizes that are multiples of 32 (16 is rejected;
#: the CPU default is 128).
BLOCK_SIZE = 32


def store_config(store: dict[str, Any], **top: Any) -> dict[str, Any]:
    """The dict form of a KVTransferConfig loading PrefixStoreConnector."""
    return {
        "kv_connector": "PrefixStoreConnector",
        "kv_connector_module_path": "kvcompose.stores",
        "kv_role": "kv_both",
        "kv_connector_extra_config": store,
        **top,
    }


@contextlib.contextmanager
def store_engine(
    model_dir: Path,
    store: dict[str, Any] | None,
    *,
    enable_prefix_caching: bool = False,
    **top: Any,
) -> Iterator[Any]:
    """A single-process CPU engine (block size 32) with a PrefixStoreConnector, or none."""
    cfg = store_config(store, **top) if store is not None else None
    with make_llm(
        model_dir, cfg, block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching
    ) as llm:
        yield llm


def run(
    llm: Any,
    requests: Sequence[tuple[str, Sequence[int]]],
    *,
    max_tokens: int = 8,
    on_step: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Greedy-generate ``(request_id, prompt_token_ids)`` pairs; returns id -> RequestOutput."""
    return generate_by_id(llm, requests, max_tokens, on_step=on_step)


def ids(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _worker_total_stats(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().total_stats.data)


def worker_stats(llm: Any) -> dict[str, Any]:
    """Cumulative PrefixStoreConnector counters of the (single) worker."""
    return llm.collective_rpc(_worker_total_stats)[0]


def statuses(llm: Any) -> dict[str, str]:
    """Request id (without vLLM's random suffix) -> scheduler status name."""
    return {rid.rsplit("-", 1)[0]: req.status.name for rid, req in scheduler(llm).requests.items()}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: after[k] - before.get(k, 0) for k in after}


def corrupt_store_files(path: Path) -> int:
    """Overwrite every stored file under ``path`` with seeded noise of the same shapes (the
    negative control: a load that reads them must change the output); returns the count."""
    import safetensors.torch
    import torch

    g = torch.Generator().manual_seed(0)
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(str(f))
        noise = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in tensors.items()}
        safetensors.torch.save_file(noise, str(f))
        n += 1
    return n
