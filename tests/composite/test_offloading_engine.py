"""vLLM's OffloadingConnector in a kvcompose tree on a real engine, with a CPU worker
(``kvcompose.testing.offloading``: vLLM's own connector, scheduler side and manager; only
the block copies are the double's).

One engine, one tree: ``chain(first)[ro (save: false), rw]``, both OffloadingConnectors. The
first run of a prompt computes it (the recompute baseline) and rw stores it; the second run
loads it from rw and gives the same tokens; noise in rw's host copy changes them (so the
loaded KV is used); ro stores nothing, plans nothing and answers every lookup at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id, make_llm
from kvcompose.introspect import node_stats, scheduler_connector, worker_connector
from kvcompose.testing.offloading import CPUCopyOffloadingWorker, offloading_leaf
from kvcompose.testing.trees import chain, kvcompose_config

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 6


def _prompt(seed: int, length: int = 150) -> list[int]:
    return [4 + (97 * seed + 13 * i + (i * i) % 7) % 1000 for i in range(length)]


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Iterator[Any]:
    tree = kvcompose_config(
        chain("tiers", offloading_leaf("ro", save=False), offloading_leaf("rw"))
    )
    with make_llm(tiny_model, tree, block_size=BLOCK, enable_prefix_caching=False) as engine:
        yield engine


def _run(llm: Any, req_id: str, prompt: list[int]) -> list[int]:
    (out,) = generate_by_id(llm, [(req_id, prompt)], MAX_TOKENS).values()
    return list(out.outputs[0].token_ids)


def _worker(name: str) -> CPUCopyOffloadingWorker:
    child = worker_connector().children[["ro", "rw"].index(name)]
    assert child.name == name
    worker = child.connector.connector_worker.worker
    assert isinstance(worker, CPUCopyOffloadingWorker)
    return worker


def test_a_reload_through_offloading_hits_and_equals_recompute(llm: Any) -> None:
    prompt = _prompt(1)
    computed = _run(llm, "a", prompt)
    loaded_before = _worker("rw").blocks_loaded
    assert _run(llm, "b", prompt) == computed
    counters = node_stats(llm)["counters"]
    assert counters.get("hits.rw") == 1 and not counters.get("hits.ro")
    # 150 prompt tokens: 4 whole blocks of 32, stored by the first run, loaded by the second
    assert counters.get("hit_tokens.rw") == 4 * BLOCK
    assert _worker("rw").blocks_loaded - loaded_before == 4
    assert _worker("rw").blocks_stored >= 4


def test_noise_in_the_offloaded_copy_changes_the_output(llm: Any) -> None:
    prompt = _prompt(2)
    computed = _run(llm, "c", prompt)
    _worker("rw").perturb(scale=20.0)
    assert _run(llm, "d", prompt) != computed


def test_a_non_saving_offloading_leaf_neither_stores_nor_waits(llm: Any) -> None:
    prompt = _prompt(3)
    _run(llm, "e", prompt)
    _run(llm, "f", prompt)  # ro is asked first: it must answer "miss" now, not "pending"
    ro = scheduler_connector(llm).children.connectors[0]
    assert _worker("ro").blocks_stored == 0
    assert not ro.connector_scheduler._jobs and not ro.has_pending_push_work()
    counters = node_stats(llm)["counters"]
    assert not counters.get("lookup_timeouts.ro") and not counters.get("hits.ro")
