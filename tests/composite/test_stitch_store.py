"""``policy: stitch`` over two real ``PrefixStoreConnector`` tiers, on vLLM's real scheduler.

The scheduler half of the store decides from file existence alone, so a tier "holds" a chunk
when its chunk file exists (written empty here); what each tier is asked to load is read
from the step's real connector metadata. No worker runs (the harness has no KV caches to
load into); the real-engine test (``test_stitch_engine.py``) loads the bytes.
"""

from __future__ import annotations

from pathlib import Path

from kvcompose.stores.prefix.keys import chunk_keys, request_salt
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

BLOCK = 16
CHUNK = 2 * BLOCK


def hold(store, request, chunks: range) -> None:
    """Make ``store`` (a PrefixStoreConnector) hold the request's prompt chunks ``chunks``."""
    sched = store.scheduler
    salt = request_salt(sched.salt, request)
    keys = chunk_keys(request.prompt_token_ids, sched.chunk_tokens, salt)
    for idx in chunks:
        for tag in sched.files.all_tags:
            Path(sched.files.file(keys[idx], tag)).touch()


def planned(result, child: int) -> list[tuple[int, list[int]]]:
    """(tokens, block ids) of each load child ``child`` was handed this step."""
    meta = result.scheduler_output.kv_connector_metadata.children[child]
    return [(load.num_tokens, load.block_ids) for load in meta.loads]


def tiers(tmp_path, policy="stitch", slow_mode="sync"):
    return kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf("fast", tmp_path / "fast", chunk_blocks=2),
            prefix_store_leaf("slow", tmp_path / "slow", chunk_blocks=2, load_mode=slow_mode),
            policy=policy,
        )
    )


def test_the_slow_tier_loads_only_what_the_fast_tier_lacks(harness, tmp_path):
    h = harness(tiers(tmp_path), with_worker=False)
    fast, slow = h.connector.children.connectors
    req = h.add_request(prompt(200), max_tokens=2)
    hold(fast, req, range(0, 2))  # [0, 64)
    hold(slow, req, range(2, 5))  # [64, 160): not the chunks the fast tier has
    result = h.step()
    rid = req.request_id
    segments = h.connector.ownership()[rid]["segments"]
    assert [(s["child"], s["range"]) for s in segments] == [("fast", [0, 64]), ("slow", [64, 160])]
    blocks = h.scheduler.kv_cache_manager.get_block_ids(rid)[0]
    assert planned(result, 0) == [(64, blocks[0:4])]
    assert planned(result, 1) == [(96, blocks[4:10])]
    assert result.scheduler_output.num_scheduled_tokens[rid] == 200 - 160
    h.run_until_idle()
    h.assert_clean()


def test_longest_reads_everything_from_the_slow_tier(harness, tmp_path):
    """The comparison: the same tiers under ``longest`` load the whole hit from one tier."""
    h = harness(tiers(tmp_path, policy="longest"), with_worker=False)
    fast, slow = h.connector.children.connectors
    req = h.add_request(prompt(200), max_tokens=2)
    hold(fast, req, range(0, 2))
    hold(slow, req, range(0, 5))
    result = h.step()
    assert planned(result, 0) == []
    assert [n for n, _ in planned(result, 1)] == [160]
    h.run_until_idle()
    h.assert_clean()


def test_a_store_tier_looks_up_from_the_chunk_holding_its_argument(harness, tmp_path):
    """The slow tier holds no chunk before 64, and still serves the range after it."""
    h = harness(tiers(tmp_path, policy="first"), with_worker=False)
    _, slow = h.connector.children.connectors
    req = h.add_request(prompt(200), max_tokens=2)
    hold(slow, req, range(2, 5))
    assert slow.get_num_new_matched_tokens(req, 0) == (0, False)
    assert slow.get_num_new_matched_tokens(req, 64) == (96, False)
    assert slow.get_num_new_matched_tokens(req, 80) == (80, False)  # inside chunk 2
    slow.request_finished(req, [])
    h.abort(req.request_id)
    h.run_until_idle()
    h.step()  # flushes the aborted id
    h.assert_clean()


def test_a_sync_fast_tier_and_an_async_slow_tier_give_one_receive(harness, tmp_path):
    h = harness(tiers(tmp_path, slow_mode="async"), with_worker=False)
    fast, slow = h.connector.children.connectors
    req = h.add_request(prompt(200), max_tokens=2)
    rid = req.request_id
    hold(fast, req, range(0, 2))
    hold(slow, req, range(2, 5))
    result = h.step()
    assert h.connector.ownership()[rid]["state"] == "loading"
    assert [n for n, _ in planned(result, 0)] == [64]
    assert [n for n, _ in planned(result, 1)] == [96]
    h.step(finished_recving=[rid])  # what the composite worker sends once the slow tier did
    h.run_until_idle()
    assert h.finished[rid].output_token_ids
    h.assert_clean()
