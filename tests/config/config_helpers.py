"""Paths and markers shared by the config and CLI tests (imported as a top-level module,
like the other test directories' helpers)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MALFORMED = Path(__file__).resolve().parent / "malformed"


def vllm_importable() -> bool:
    from kvcompose.config import vllm_available

    return vllm_available()


needs_vllm = pytest.mark.skipif(not vllm_importable(), reason="vLLM is not installed")
