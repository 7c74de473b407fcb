"""Hypothesis profiles for the randomized reliability suite, and its figures.

- ``ci`` (the default): a few hundred state-machine sequences over all tree shapes, a few
  minutes on 2 cores;
- ``long``: ≥ 10,000 sequences (``HYPOTHESIS_PROFILE=long pytest tests/reliability -m slow``).

Set ``KVCOMPOSE_RELIABILITY_STATS=path.json`` to have the figures of the run (examples,
steps, requests, loads, aborts by phase, preemptions, failures, violations, seconds) written
at the end of the session.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=(
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ),
    print_blob=True,
)
#: Per tree shape (eleven shapes): 11 x 100 = 1,100 sequences, about 3 minutes on 2 cores.
settings.register_profile("ci", max_examples=100, stateful_step_count=50, **_COMMON)
#: Per tree shape: 11 x 2,000 = 22,000 sequences.
settings.register_profile("long", max_examples=2000, stateful_step_count=60, **_COMMON)


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """Thousands of schedulers are built, children raise on purpose: keep the log quiet
    (vLLM re-applies its own logging config, so levels would not stick)."""
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture(scope="session", autouse=True)
def _write_stats() -> Iterator[None]:
    yield
    path = os.environ.get("KVCOMPOSE_RELIABILITY_STATS")
    if path:
        from machine_stats import STATS

        with open(path, "w") as fh:
            json.dump(dict(sorted(STATS.items())), fh, indent=1)
