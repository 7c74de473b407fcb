"""vLLM's own OffloadingConnector as the *target* of promotion: it saves the blocks another
child of the chain loaded into the request (docs/stores.md, "Other connectors").

Only the scheduler half runs here: vLLM's CPU build refuses the offloading worker (CUDA/XPU
only: ``CPUOffloadingSpec.get_worker`` in vllm/v1/kv_offload/cpu/spec.py raises on other
platforms; docs/stores.md, "Other connectors"), and the decision to store is the scheduler's.
Its worker submits a step's store jobs at the start of the *next* step
(``OffloadingConnectorWorker.prepare_store_kv`` in ``offloading/worker.py``: "defer the
store to the beginning of the next engine step"), so a sibling's load in the same step has
finished before the copy starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config

pytestmark = pytest.mark.v033

BLOCK = 16


def _offloading_leaf() -> dict[str, Any]:
    return {
        "kind": "leaf",
        "name": "fast",
        "connector": "OffloadingConnector",
        "extra_config": {"cpu_bytes_to_use": 1 << 26, "block_size": BLOCK},
    }


def _stored_blocks(metadata: Any) -> set[int]:
    """The GPU block ids the OffloadingConnector's step metadata asks its worker to store."""
    offloading = metadata.children[0]
    assert type(offloading).__name__ == "OffloadingConnectorMetadata"
    return {int(b) for job in offloading.store_jobs.values() for b in job.src_spec.block_ids}


@pytest.mark.parametrize("policy", ["first", "longest"])
def test_offloading_stores_the_blocks_a_sibling_loaded(
    harness_factory: Callable[..., Any], policy: str
) -> None:
    script("slow", Behaviour(tokens=64))  # the slow tier holds the first 4 blocks
    config = kvcompose_config(chain("tiers", _offloading_leaf(), leaf("slow"), policy=policy))
    h = harness_factory(config, block_size=BLOCK, with_worker=False)
    request = h.add_request(num_tokens=100, max_tokens=4)

    first = h.step()
    new = first.scheduler_output.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 64  # loaded by "slow": Offloading held nothing
    loaded = set(new.block_ids[0][:4])
    stored = _stored_blocks(first.scheduler_output.kv_connector_metadata)
    # Every full block of the prompt that the step computes or another child loaded:
    # 6 of 100 tokens' blocks, the 4 "slow" loaded among them.
    assert loaded <= stored
    assert stored == set(new.block_ids[0][:6])
    for _ in range(4):  # max_tokens: the request finishes on its own
        h.step()
    # (No run_until_idle: without a worker, Offloading's store jobs never report done.)
    assert request.request_id in h.finished


def test_offloading_stores_nothing_it_was_not_given(harness_factory: Callable[..., Any]) -> None:
    """The control: without the sibling's hit the same step stores only what it computed,
    so the loaded blocks above are stored because they were loaded, not by accident."""
    script("slow", Behaviour(tokens=0))
    config = kvcompose_config(chain("tiers", _offloading_leaf(), leaf("slow")))
    h = harness_factory(config, block_size=BLOCK, with_worker=False, max_num_batched_tokens=40)
    h.add_request(num_tokens=100, max_tokens=4)
    first = h.step()
    new = first.scheduler_output.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0
    # A 40-token chunk computes 2 full blocks; only those are stored this step.
    assert _stored_blocks(first.scheduler_output.kv_connector_metadata) == set(new.block_ids[0][:2])
