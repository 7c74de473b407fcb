"""Fixtures for the PrefixStoreConnector tests (tiny local Llama, no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose.testing.engine import engine_env

engine_env()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The shared tiny Llama (2 layers, hidden 128, 4 heads of 32, vocab 1024, seed 0)."""
    from kvcompose.engine.model import build_tiny_model, default_cache_dir

    return Path(build_tiny_model(default_cache_dir() / "tiny-llama"))
