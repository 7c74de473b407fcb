"""Shared fixtures: the tiny local model, the scheduler harness.

The environment is set before anything imports vLLM (or torch/OpenMP): offline hub,
single-process engines, passive OpenMP waiting (10-30x faster generation on 2 cores),
CPU platform, a 1 GiB CPU KV cache.
"""

from __future__ import annotations

import os

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

import importlib.util  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

#: The proxy's tests need its web stack (the ``proxy`` extra: FastAPI, uvicorn, httpx), which
#: the lean vLLM 0.33 environment does not install; they exercise no vLLM 0.33 behaviour.
collect_ignore = (
    [] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")) else ["proxy"]
)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama (2 layers, hidden 128, 4 heads of 32, vocab 1024, seed 0), built once
    under ``$KVCOMPOSE_CACHE`` (default ``~/.cache/kvcompose``) and reused across runs."""
    from kvcompose.engine.model import build_tiny_model, default_cache_dir

    return build_tiny_model(default_cache_dir() / "tiny-llama")


@pytest.fixture
def harness_factory(tiny_model: Path) -> Iterator[Callable[..., Any]]:
    """``harness_factory(kv_transfer_config=None, **kw)`` → a ``SchedulerHarness`` over the
    tiny model (keywords as ``SchedulerHarness``; ``model_dir=`` picks another model).
    Every harness made is closed after the test."""
    from kvcompose.engine.harness import SchedulerHarness

    made: list[SchedulerHarness] = []

    def make(kv_transfer_config: dict[str, Any] | None = None, **kw: Any) -> SchedulerHarness:
        model_dir = kw.pop("model_dir", tiny_model)
        h = SchedulerHarness(model_dir, kv_transfer_config, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
