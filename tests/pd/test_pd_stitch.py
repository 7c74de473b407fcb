"""Prefill/decode over real NIXL with a stitched load on D: D's disk tier holds the first part
of the prompt, NIXL pulls only the rest from P.

D runs ``chain/stitch[disk, nixl]`` (``kv_load_failure_policy: recompute``): the disk tier
(``PrefixStoreConnector``, ``native``) is looked up at D's local hit and loads its prefix
``[0, a)`` (sync); ``NixlConnector`` (``last_segment``) is looked up at ``a`` (it answers
``prompt - a``, ``NixlPullConnectorScheduler.get_num_new_matched_tokens``) and is handed a
block view starting at block ``a / 32``, so it pulls exactly the blocks after the disk segment
(the worker keeps the last ``len(local)`` remote blocks,
``NixlBaseConnectorWorker._apply_prefix_caching``). P runs ``chain/first[nixl]``.

What moved is read from real counters, not from the composite's plan: NIXL's
``vllm:nixl_bytes_transferred`` (against a whole-prompt pull measured on the same pair), the
disk tier's worker-side ``tokens_loaded``, and the tokens D's engine computed per request
(``pd.trace_on``'s ``scheduled``). The failure test hands D ``kv_transfer_params`` naming
blocks P does not have: NIXL refuses the read (``make_prepped_xfer`` raises
``NIXL_ERR_INVALID_PARAM`` in ``NixlPullConnectorWorker._read_blocks``) and reports the
request failed with its view's blocks invalid (``NixlBaseConnectorWorker.
get_transfer_results``); see docs/pd.md for why an expired lease is no such failure on vLLM
0.32.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pd_scenarios import (
    BLOCK,
    D_TOKENS,
    FREE_WITHIN_S,
    FULL_PREFIX,
    PROMPT_LEN,
    assert_clean,
    assert_crossed,
    assert_p_freed_fast,
    disk_leaf,
    handoff,
    nixl_leaf,
    p_request_freed,
    prompt,
    seed_disk,
    start_engine,
)

from kvcompose.introspect import node_stats
from kvcompose.testing import faulty_store, pd
from kvcompose.testing.pd import EngineProcess
from kvcompose.testing.trees import chain, kvcompose_config

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(600)]

SEEDS = range(50, 55)
#: D's request id whose disk-tier loads fail (``kvcompose.testing.faulty_store``).
DISK_FAILS = "disk-fails"
PROMPT_BLOCKS = -(-PROMPT_LEN // BLOCK)  # 7: P holds and a whole pull moves 7 blocks


@dataclass
class Bed:
    prefill: EngineProcess
    decode: EngineProcess
    ref: dict[int, list[int]]  # greedy outputs of one engine, by prompt seed
    block_bytes: float  # what NIXL moves per block (measured on a whole-prompt pull)


def _nixl_idle(events: list[dict[str, Any]]) -> bool:
    lookups = [ev["result"] for ev in events if ev["kind"] == "lookup"]
    return bool(lookups) and all(tuple(r) == (0, False) for r in lookups)


@pytest.fixture(scope="module")
def bed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    pytest.importorskip("nixl")
    stores = tmp_path_factory.mktemp("pd-stitch")
    p_cfg = kvcompose_config(chain("p", nixl_leaf()), kv_buffer_device="cpu")
    # D's disk tier is the store itself, with one switch: loads of DISK_FAILS fail
    disk = disk_leaf(stores / "d")
    # (range modes go by class name, so the subclass says it is the store's: native)
    disk.update(
        connector=faulty_store.CONNECTOR, module_path=faulty_store.MODULE_PATH, load_range="native"
    )
    disk["extra_config"]["fail_load_request_ids"] = [DISK_FAILS]
    d_cfg = kvcompose_config(
        chain("d", disk, nixl_leaf(), policy="stitch"),
        kv_buffer_device="cpu",
        kv_load_failure_policy="recompute",
    )
    prefill = start_engine(tiny_model, p_cfg, "prefill")
    try:
        decode = start_engine(tiny_model, d_cfg, "decode-stitch")
        try:
            # The reference: P runs every prompt itself, greedily, without a hand-off; NIXL
            # takes no part (asked without kv_transfer_params it answers 0) and moves nothing.
            outs = prefill.call(pd.run_requests, [prompt(s) for s in SEEDS], D_TOKENS)
            assert _nixl_idle(prefill.call(pd.take_trace)["events"])
            assert prefill.call(pd.reset_prefix_cache)
            ref = {s: out["token_ids"] for s, out in zip(SEEDS, outs, strict=True)}
            # The NIXL handshake, and what a whole-prompt pull moves (D's disk holds nothing)
            whole = handoff(prefill, decode, prompt(1))
            assert_crossed(whole)
            assert whole.transfers == 1 and whole.p_blocks == PROMPT_BLOCKS
            assert_clean(prefill, decode)
            print(f"whole pull: {whole.row()}")
            yield Bed(prefill, decode, ref, whole.bytes_moved / PROMPT_BLOCKS)
        finally:
            decode.close(graceful=False)  # the module's tests are done with them
    finally:
        prefill.close(graceful=False)


def _disk_loaded(decode: EngineProcess) -> int:
    return decode.call(pd.store_totals)["disk"]["tokens_loaded"]


@pytest.mark.parametrize(
    ("seed", "stored", "disk_tokens"),
    [
        (50, 70, 64),  # the disk holds 2 blocks: NIXL pulls 5 of P's 7
        (51, PROMPT_LEN, FULL_PREFIX),  # all a store can hold: NIXL pulls the 8-token tail
    ],
    ids=["disk-64", "disk-192"],
)
def test_disk_loads_its_prefix_and_nixl_pulls_only_the_rest(bed, seed, stored, disk_tokens):
    p, d = bed.prefill, bed.decode
    seed_disk(d, prompt(seed)[:stored])
    disk_before = _disk_loaded(d)
    h = handoff(p, d, prompt(seed))
    rest = PROMPT_LEN - disk_tokens
    # (a) the output of one engine
    assert h.d_tokens == bed.ref[seed], h.row()
    # the stitch: disk looked up at D's local hit (0), NIXL where the disk ends
    assert h.d_local == 0
    assert h.offers == {"disk": (disk_tokens, False), "nixl": (rest, True)}
    assert h.allocs == {"disk": disk_tokens, "nixl": rest}
    # (b) what moved: the disk tier read its prefix; NIXL one transfer of only the blocks
    # after it; D computed no prompt token but the last (a full prompt hit recomputes it,
    # ``Scheduler._update_waiting_for_remote_kv``)
    assert _disk_loaded(d) - disk_before == disk_tokens
    assert h.transfers == 1
    assert h.bytes_moved == bed.block_bytes * (PROMPT_BLOCKS - disk_tokens // BLOCK), h.row()
    assert h.external_hits == PROMPT_LEN
    assert h.d_prompt_computed == 1, h.row()
    # (c) P freed its blocks within a few of its steps of D's allocation, and holds nothing
    assert h.p_blocks == PROMPT_BLOCKS
    assert_p_freed_fast(h)
    assert_clean(p, d)
    print(f"stitch, disk {disk_tokens}: {h.row()}")


def test_stitched_output_depends_on_the_kv_nixl_pulled(bed):
    """Negative control: P's blocks overwritten with noise before D's read. NIXL still pulls
    the 5 blocks after the disk segment, and D's output changes, so D decodes from them."""
    p, d = bed.prefill, bed.decode
    seed_disk(d, prompt(52)[:70])
    h = handoff(p, d, prompt(52), corrupt_p=True)
    assert h.allocs == {"disk": 64, "nixl": PROMPT_LEN - 64}
    assert h.bytes_moved == bed.block_bytes * (PROMPT_BLOCKS - 2)
    assert h.d_tokens != bed.ref[52]
    assert_clean(p, d)


def _blocks_p_lacks(total_blocks: int) -> Any:
    """Fault injection: the hand-off names blocks beyond P's KV cache (P's blocks are gone)."""

    def tamper(params: dict[str, Any]) -> dict[str, Any]:
        ids = params["remote_block_ids"]
        params["remote_block_ids"] = [[b + total_blocks for b in group] for group in ids]
        return params

    return tamper


def test_a_failed_nixl_segment_keeps_the_disk_segment(bed):
    """(d) NIXL's read fails: the composite sends the NIXL segment's blocks up as invalid
    with the one receive, vLLM keeps the disk's 64 tokens and recomputes only NIXL's 136
    (no re-lookup); the output still equals one engine's. P was never read from, so it keeps
    its blocks until the router releases the hand-off through D (kvcompose proxy's release
    path) or its lease ends."""
    p, d = bed.prefill, bed.decode
    seed_disk(d, prompt(53)[:70])
    disk_before = _disk_loaded(d)
    failed_before = d.stats()["vllm:nixl_num_failed_transfers"]
    lookups_before = d.call(node_stats)["counters"]["lookups"]
    tamper = _blocks_p_lacks(p.inspect()["total_blocks"])
    h = handoff(p, d, prompt(53), tamper=tamper, p_free_timeout=0.5)
    assert h.d_tokens == bed.ref[53], h.row()
    assert h.allocs == {"disk": 64, "nixl": PROMPT_LEN - 64}
    # NIXL failed the read and moved nothing; the disk segment was loaded and kept
    assert d.stats()["vllm:nixl_num_failed_transfers"] == failed_before + 1
    assert h.transfers == 0
    assert _disk_loaded(d) - disk_before == 64
    assert h.d_prompt_computed == PROMPT_LEN - 64, h.row()  # only NIXL's segment recomputed
    assert d.call(node_stats)["counters"]["lookups"] == lookups_before + 1  # no re-lookup
    # P still holds the 7 blocks for a read that never came; D's rejection path frees them
    assert p.inspect()["requests"][h.p_request]["blocks"] == PROMPT_BLOCKS
    d.call(pd.submit_and_abort, prompt(53), D_TOKENS, h.params, when="queued")
    assert p.wait_until(p_request_freed(h.p_request), FREE_WITHIN_S) is not None
    assert_clean(p, d)
    print(f"stitch, NIXL failed: {h.row()}")


def test_a_failed_disk_segment_is_recomputed_and_nixl_still_frees_p(bed):
    """(d') The first segment fails: the disk tier's sync load reports its blocks invalid
    (``FaultyPrefixStoreConnector``; the store itself otherwise). vLLM keeps the valid
    prefix before the first invalid block (none: the disk segment starts at 0), so D
    recomputes the prompt, while NIXL's segment still pulls its 5 blocks and P is freed
    as after any pull; the output equals one engine's."""
    p, d = bed.prefill, bed.decode
    seed_disk(d, prompt(54)[:70])
    disk_before = _disk_loaded(d)
    h = handoff(p, d, prompt(54), d_request_id=DISK_FAILS)
    assert h.d_tokens == bed.ref[54], h.row()
    assert h.offers == {"disk": (64, False), "nixl": (PROMPT_LEN - 64, True)}
    assert h.allocs == {"disk": 64, "nixl": PROMPT_LEN - 64}
    assert _disk_loaded(d) == disk_before  # the disk read nothing
    assert h.transfers == 1  # NIXL's segment went through
    assert h.bytes_moved == bed.block_bytes * (PROMPT_BLOCKS - 2), h.row()
    assert h.d_prompt_computed == PROMPT_LEN, h.row()  # nothing before the disk segment kept
    assert_p_freed_fast(h)
    assert_clean(p, d)
    print(f"stitch, disk failed: {h.row()}")
