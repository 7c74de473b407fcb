"""Fixtures for the multi-engine tests: a Mooncake Store cluster (master + pool) shared by
several real engines running at once (``kvcompose.testing.mooncake``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.testing.mooncake import MooncakeCluster, mooncake_missing


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    """A master and a 256 MB pool on free ports; every engine started through it and both
    servers are stopped at the end of the module, whatever happened."""
    missing = mooncake_missing()
    if missing:
        pytest.skip(f"Mooncake Store cannot run here: {missing} (scripts/setup.sh installs it)")
    bed = MooncakeCluster(tmp_path_factory.mktemp("mooncake"))
    try:
        bed.start()
        yield bed
    finally:
        bed.stop()


@pytest.fixture
def empty_store(cluster: MooncakeCluster) -> MooncakeCluster:
    """The cluster with nothing stored (every object removed before the test)."""
    cluster.clear()
    assert cluster.keys() == []
    return cluster


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model
