"""Fixtures for the PrefixStoreConnector tests (tiny local Llama, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.testing.real_engine import engine_env

engine_env()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shared tiny Llama (2 layers, hidden 128, 4 heads of 32, vocab 1024, seed 0)."""
    from kvcompose.engine.model import build_tiny_model, default_cache_dir

    return Path(build_tiny_model(default_cache_dir() / "tiny-llama"))


@pytest.fixture(scope="session")
def hybrid_model_dir() -> Path:
    """The hybrid Llama (4 layers, sliding window 64 on layers 0 and 2): 2 KV cache groups."""
    from kvcompose.engine.model import tiny_hybrid_model

    return Path(tiny_hybrid_model())
