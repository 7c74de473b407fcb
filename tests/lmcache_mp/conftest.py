"""Fixtures for the tests of LMCache's multi-process mode on real engines: one
``lmcache server`` per module (``kvcompose.testing.lmcache_server``), stopped, and the
shared-memory segments it and its engines leave removed, whatever happened. They run in
``.venv-lmcache`` (``scripts/setup.sh``); elsewhere they are skipped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.testing.lmcache_server import LMCacheServer, lmcache_missing

#: LMCache's chunk (tokens): the tests' engines use blocks of 32, so a chunk is two blocks.
CHUNK = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """An ``lmcache server`` on free ports for the whole module, started through the bed's
    hooks (``hold_retrieves()``: the kill test pins its kill inside a load)."""
    missing = lmcache_missing()
    if missing:
        pytest.skip(f"LMCache cannot run here: {missing}")
    bed = LMCacheServer(tmp_path_factory.mktemp("lmcache"), chunk_size=CHUNK, hooks=True)
    try:
        bed.start()
        yield bed
    finally:
        bed.stop()


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model
