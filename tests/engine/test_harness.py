"""The scheduler harness drives vLLM's real Scheduler (runs under vLLM 0.32 and 0.33).

Connector used: vLLM's own ExampleConnector (disk store), scheduler side real; the worker side
is driven through the model runner's per-step sequence without a model.
"""

from __future__ import annotations

import pytest

BLOCK = 16


def _example_config(path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _example_meta(step):
    """ExampleConnector's per-request entries in this step's connector metadata."""
    meta = step.scheduler_output.kv_connector_metadata
    return list(meta.requests)


def test_plain_request_runs_to_completion_and_frees_everything(harness_factory):
    from vllm.v1.engine import FinishReason

    h = harness_factory(None, block_size=BLOCK, num_blocks=64)
    assert h.scheduler.connector is None and h.num_free_blocks() == h.num_usable_blocks()
    req = h.add_request(num_tokens=40, max_tokens=3)

    first = h.step()
    assert first.scheduled == {req.request_id: 40}
    # 40 prompt tokens + the slot for the first sampled token: 3 blocks of 16.
    assert h.num_usable_blocks() - h.num_free_blocks() == 3
    assert len(first.sampled[req.request_id]) == 1

    rest = h.run_until_idle()
    done = [s for s in [first, *rest] if req.request_id in s.finished]
    assert len(done) == 1
    info = done[0].finished[req.request_id]
    assert info.finish_reason == FinishReason.LENGTH
    assert len(info.output_token_ids) == 3
    h.assert_clean()


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt(harness_factory):
    h = harness_factory(None, block_size=BLOCK, max_num_batched_tokens=32)
    req = h.add_request(num_tokens=80, max_tokens=2)
    steps = h.run_until_idle()
    chunks = [s.scheduled.get(req.request_id, 0) for s in steps]
    assert chunks[:3] == [32, 32, 16]
    assert [len(s.sampled.get(req.request_id, [])) for s in steps[:3]] == [0, 0, 1]
    assert h.finished[req.request_id].output_token_ids == list(req.output_token_ids)
    h.assert_clean()


@pytest.mark.parametrize("with_worker", [False, True])
def test_example_connector_store_then_external_hit(harness_factory, tmp_path, with_worker):
    """First request: ExampleConnector plans a store. Once the store holds the prefix, an
    identical request gets an external hit: the scheduler counts the loaded tokens as
    computed and the connector plans a load."""
    h = harness_factory(
        _example_config(tmp_path),
        block_size=BLOCK,
        enable_prefix_caching=False,  # so the hit cannot come from the local prefix cache
        with_worker=with_worker,
    )
    assert type(h.connector).__name__ == "ExampleConnector"
    assert (h.worker_connector is not None) == with_worker

    a = h.add_request(num_tokens=40, max_tokens=2)
    s0 = h.step()
    (entry,) = _example_meta(s0)
    assert entry.is_store and len(entry.token_ids) == 32  # block-aligned part of prompt[:-1]
    h.run_until_idle()
    h.assert_clean()

    # The worker side would have written one file per layer; create the entry it checks.
    import torch

    h.connector._generate_foldername_debug(
        torch.tensor(a.prompt_token_ids[:32]), [], create_folder=True
    )

    b = h.add_request(list(a.prompt_token_ids), max_tokens=2)
    s1 = h.step()
    (entry,) = _example_meta(s1)
    assert not entry.is_store and len(entry.token_ids) == 32
    assert s1.scheduled[b.request_id] == 40 - 32
    (new,) = s1.scheduler_output.scheduled_new_reqs
    assert new.req_id == b.request_id and new.num_computed_tokens == 32
    assert s1.scheduler_stats.connector_prefix_cache_stats.hits == 32
    h.run_until_idle()
    assert len(h.finished[b.request_id].output_token_ids) == 2
    h.assert_clean()


def test_abort_and_preempt_leave_nothing_behind(harness_factory, tmp_path):
    from vllm.v1.engine import FinishReason

    h = harness_factory(_example_config(tmp_path), block_size=BLOCK, with_worker=True)
    keep = h.add_request(num_tokens=50, max_tokens=6)
    drop = h.add_request(num_tokens=30, max_tokens=6)
    h.step()
    h.step()
    h.abort(drop.request_id)
    assert h.finished[drop.request_id].finish_reason == FinishReason.ABORT

    before = h.num_free_blocks()
    h.preempt(keep.request_id)
    assert h.num_free_blocks() > before  # its blocks went back to the pool
    assert keep.num_computed_tokens == 0 and keep.num_preemptions == 1
    nxt = h.step()
    assert keep.request_id in nxt.scheduled  # resumed through a fresh lookup
    h.run_until_idle()
    assert len(h.finished[keep.request_id].output_token_ids) == 6
    h.assert_clean()


def test_natural_preemption_with_a_small_pool(harness_factory):
    """Two long requests in 9 usable blocks: the scheduler preempts one by itself."""
    h = harness_factory(None, block_size=BLOCK, num_blocks=10)
    r1 = h.add_request(num_tokens=64, max_tokens=40)
    r2 = h.add_request(num_tokens=64, max_tokens=40)
    h.run_until_idle(max_steps=500)
    assert r1.num_preemptions + r2.num_preemptions >= 1
    assert len(h.finished[r1.request_id].output_token_ids) == 40
    assert len(h.finished[r2.request_id].output_token_ids) == 40
    h.assert_clean()


def test_assert_clean_catches_leftovers(harness_factory):
    h = harness_factory(None, block_size=BLOCK)
    h.add_request(num_tokens=20, max_tokens=4)
    h.step()
    with pytest.raises(AssertionError, match="not clean"):
        h.assert_clean()
    h.run_until_idle()
    h.assert_clean()


def test_run_until_idle_reports_a_stuck_scheduler(harness_factory):
    from kvcompose.engine.harness import HarnessStuck

    h = harness_factory(None, block_size=BLOCK)
    h.add_request(num_tokens=20, max_tokens=50)
    with pytest.raises(HarnessStuck, match="still busy"):
        h.run_until_idle(max_steps=5)


def test_probe_walks_a_real_connector_tree(harness_factory):
    """``walk_connectors`` names kvcompose children by node name, MultiConnector's by index
    and class, and joins paths below the root with ``/``."""
    from kvcompose.config import load_config
    from kvcompose.config.render import vllm_args
    from kvcompose.engine.probe import walk_connectors
    from kvcompose.testing.noop import MODULE_PATH, noop_config

    noop = {"connector": "NoopConnector", "module_path": MODULE_PATH}
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [noop_config(), noop_config()]},
    }
    document = {
        "version": 1,
        "kv_role": "kv_both",
        "tree": {
            "chain": {
                "name": "tiers",
                "policy": "first",
                "children": [
                    {"leaf": {"name": "fast", **noop}},
                    {
                        "leaf": {
                            "name": "pair",
                            "connector": "MultiConnector",
                            "extra_config": multi["kv_connector_extra_config"],
                        }
                    },
                ],
            }
        },
    }
    h = harness_factory(vllm_args(load_config(document, env={})), block_size=BLOCK, num_blocks=64)
    nodes = list(walk_connectors(h.scheduler.connector))
    assert [(n.path, n.name, n.parent) for n in nodes] == [
        ("root", "root", None),
        ("fast", "fast", "root"),
        ("pair", "pair", "root"),
        ("pair/0.NoopConnector", "0.NoopConnector", "pair"),
        ("pair/1.NoopConnector", "1.NoopConnector", "pair"),
    ]
    assert nodes[0].connector is h.scheduler.connector
    assert type(nodes[3].connector).__name__ == "NoopConnector"
