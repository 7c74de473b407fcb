"""Randomized sequences on vLLM's real scheduler (see ``kv_machine.KVComposeMachine``).

One test per tree shape: a 2-child chain (``first`` and ``longest``), a route, a fan-out, a
2-level nested tree, two ``stitch`` chains (four leaves, one a sole owner; and one with a
nested chain as a sole-owner child) two ``fastest`` chains (four leaves of known priors;
and two of them cold), and a ``first`` chain and a ``stitch`` chain on a model with 2 KV cache
groups (``hma-*``: failures go up by request). ``test_random_sequences`` runs the ``ci`` profile and
is part of every run; ``test_random_sequences_long`` runs the ``long`` profile and only when
``HYPOTHESIS_PROFILE=long`` (it is marked ``slow``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kv_machine import SHAPES, machine_for

SHAPE_NAMES = sorted(SHAPES)


@pytest.mark.parametrize("shape", SHAPE_NAMES)
def test_random_sequences(shape: str, tiny_model: Path) -> None:
    run_state_machine_as_test(machine_for(shape, tiny_model), settings=settings.get_profile("ci"))


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("HYPOTHESIS_PROFILE") != "long",
    reason="the long profile runs with HYPOTHESIS_PROFILE=long",
)
@pytest.mark.parametrize("shape", SHAPE_NAMES)
def test_random_sequences_long(shape: str, tiny_model: Path) -> None:
    run_state_machine_as_test(machine_for(shape, tiny_model), settings=settings.get_profile("long"))
