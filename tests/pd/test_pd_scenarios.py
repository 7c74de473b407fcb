"""Prefill/decode over real NIXL between two vLLM engines, each with a kvcompose tree holding
NixlConnector and a disk tier (PrefixStoreConnector): who owns each load on the decode side,
whether NIXL hears about it, and how long the prefill side keeps its blocks.

The engines (one P, two D: chain/first[disk, nixl] and chain/longest[disk, nixl]) start once
per module; every test ends with neither engine holding a request, a used block, or an entry
in kvcompose's or NIXL's per-request tables. NIXL's lease on P's blocks is 300 s, so "P freed
within a few steps" cannot be the lease. Measurement details: tests/pd/pd_scenarios.py;
figures and the MultiConnector baseline: docs/pd.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_scenarios import (
    D_TOKENS,
    FREE_WITHIN_S,
    FULL_PREFIX,
    PROMPT_LEN,
    _node,
    assert_clean,
    assert_crossed,
    assert_p_freed_fast,
    decode_only,
    handoff,
    kvcompose_configs,
    p_request_freed,
    prompt,
    reference,
    seed_disk,
    start_engine,
)

from kvcompose.testing import pd
from kvcompose.testing.pd import EngineProcess

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(900)]

SEEDS = range(20, 40)


@pytest.fixture(scope="module")
def ref(tiny_model: Path) -> dict[int, list[int]]:
    """Greedy outputs of a single engine without connectors, per prompt seed."""
    pytest.importorskip("nixl")
    return dict(zip(SEEDS, reference(tiny_model, [prompt(s) for s in SEEDS]), strict=True))


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-stores")


@pytest.fixture(scope="module")
def prefill(ref: dict[int, list[int]], tiny_model: Path, stores: Path) -> Iterator[EngineProcess]:
    engine = start_engine(tiny_model, kvcompose_configs(stores)[0], "prefill")
    yield engine
    engine.close(graceful=False)  # the module's tests are done with it


def _decode(
    tiny_model: Path, stores: Path, prefill: EngineProcess, policy: str
) -> Iterator[EngineProcess]:
    engine = start_engine(tiny_model, kvcompose_configs(stores, policy)[1], f"decode-{policy}")
    try:
        handoff(prefill, engine, prompt(1))  # the NIXL handshake, out of the measurements
        assert_clean(prefill, engine)
        yield engine
    finally:
        engine.close(graceful=False)


@pytest.fixture(scope="module")
def decode(tiny_model: Path, stores: Path, prefill: EngineProcess) -> Iterator[EngineProcess]:
    """D = chain/first[disk, nixl]."""
    yield from _decode(tiny_model, stores, prefill, "first")


@pytest.fixture(scope="module")
def decode_longest(
    tiny_model: Path, stores: Path, prefill: EngineProcess
) -> Iterator[EngineProcess]:
    """D = chain/longest[disk, nixl]."""
    yield from _decode(tiny_model, stores, prefill, "longest")


# ----------------------------------------------------------------------------- 1


def test_cold_decode_pulls_the_prompt_over_nixl(ref, prefill, decode):
    h = handoff(prefill, decode, prompt(20))
    assert h.d_tokens == ref[20]
    assert h.offers == {"disk": (0, False), "nixl": (PROMPT_LEN, True)}
    assert_crossed(h)  # NIXL owned all 200 tokens, moved bytes; D: 200 external hits
    assert h.p_blocks == 7
    assert h.hold_s is not None and h.hold_s < FREE_WITHIN_S and h.freed_before_d_done
    assert_clean(prefill, decode)
    print(f"cold D: {h.row()}")


def test_cold_decode_negative_controls(ref, prefill, decode):
    # No hand-off: D computes the prompt itself; the transfer check must fail.
    local = decode_only(decode, prompt(21))
    assert local.d_tokens == ref[21]
    with pytest.raises(AssertionError):
        assert_crossed(local)
    assert local.transfers == 0 and local.external_hits == 0
    # P's blocks overwritten with noise before D reads them: D's output changes, so D
    # decodes from the KV that crossed, not from a recomputation.
    bad = handoff(prefill, decode, prompt(22), corrupt_p=True)
    assert_crossed(bad)
    assert bad.d_tokens != ref[22]
    assert_clean(prefill, decode)


# ----------------------------------------------------------------------------- 2


def test_disk_tier_owns_the_load_and_p_is_freed_before_d_ends(ref, prefill, decode):
    seed_disk(decode, prompt(23))
    h = handoff(prefill, decode, prompt(23))
    assert h.d_tokens == ref[23]
    # first: the disk tier answers first and owns the load; NIXL is told 0 and not asked
    assert h.offers == {"disk": (FULL_PREFIX, False)}
    assert h.allocs == {"disk": FULL_PREFIX, "nixl": 0} and h.owner == "disk"
    assert h.transfers == 0 and h.external_hits == FULL_PREFIX
    assert_p_freed_fast(h)  # < 5 s after D's allocation, before D ended; lease is 300 s
    assert_clean(prefill, decode)
    print(
        f"disk owns: P held {h.p_blocks} blocks {h.hold_s * 1000:.0f} ms "
        f"({h.p_steps} P steps) after D's allocation; {h.row()}"
    )


def test_disk_tier_owns_negative_control_without_the_zero_call(ref, prefill, decode):
    """The seed bug, half of it: NIXL does not hear the 0-token allocation. P then keeps its
    blocks through D's whole request (vLLM 0.32's NIXL frees them from request_finished on
    D); the check of the previous test fails."""
    node = _node(decode, "nixl")
    decode.call(pd.drop_calls, node, "update_state_after_alloc", zero_only=True)
    try:
        seed_disk(decode, prompt(24))
        h = handoff(prefill, decode, prompt(24))
    finally:
        decode.call(pd.drop_calls, node, "update_state_after_alloc", enable=False)
    assert h.dropped == 1 and h.owner == "disk" and h.d_tokens == ref[24]
    assert not h.freed_before_d_done
    with pytest.raises(AssertionError):
        assert_p_freed_fast(h)
    assert_clean(prefill, decode)
    print(
        f"without the 0-call: P held its blocks {h.hold_s * 1000:.0f} ms, "
        f"until D's request ended; {h.row()}"
    )


# ----------------------------------------------------------------------------- 3


@pytest.mark.parametrize(
    ("seed", "stored", "disk_tokens"),
    [
        (25, 70, 64),  # disk holds 2 blocks of the prompt
        (26, PROMPT_LEN, FULL_PREFIX),  # disk holds all it can: every block inside prompt[:-1]
    ],
    ids=["disk-64", "disk-full"],
)
def test_longest_remote_prefill_covers_more_than_the_disk(
    ref, prefill, decode_longest, seed, stored, disk_tokens
):
    """NIXL offers the whole prompt minus the local hit; a store, at most prompt[:-1] minus
    the same hit. So on plain attention models NIXL's offer is always the longer one: a disk
    prefix longer than NIXL's offer cannot happen (docs/pd.md)."""
    seed_disk(decode_longest, prompt(seed)[:stored])
    h = handoff(prefill, decode_longest, prompt(seed))
    assert h.d_tokens == ref[seed]
    assert h.offers == {"disk": (disk_tokens, False), "nixl": (PROMPT_LEN, True)}
    assert h.allocs == {"disk": 0, "nixl": PROMPT_LEN}
    assert_crossed(h)
    assert h.hold_s is not None and h.hold_s < FREE_WITHIN_S and h.freed_before_d_done
    assert_clean(prefill, decode_longest)
    print(f"longest, disk {disk_tokens}: {h.row()}")


# ----------------------------------------------------------------------------- 4


def test_full_local_hit_on_decode_pulls_only_the_tail(ref, prefill, decode):
    first = handoff(prefill, decode, prompt(27))
    assert_crossed(first)
    h = handoff(prefill, decode, prompt(27))
    assert first.d_tokens == h.d_tokens == ref[27]
    # D's local hit is capped at prompt - 1, block-aligned: 192; the disk tier holds the same
    # 192 (nothing beyond the hit); NIXL still asks for the 8-token tail and pulls it.
    assert h.d_local == FULL_PREFIX
    assert h.offers == {"disk": (0, False), "nixl": (PROMPT_LEN - FULL_PREFIX, True)}
    assert h.allocs == {"disk": 0, "nixl": PROMPT_LEN - FULL_PREFIX}
    assert h.transfers == 1 and 0 < h.bytes_moved < first.bytes_moved  # one block of seven
    assert h.bytes_moved * 7 == first.bytes_moved
    assert h.external_hits == PROMPT_LEN - FULL_PREFIX
    assert h.hold_s is not None and h.hold_s < FREE_WITHIN_S and h.freed_before_d_done
    assert_clean(prefill, decode)
    print(f"full local hit: {h.row()}")


# ----------------------------------------------------------------------------- 5


def _p_prefill(prefill: EngineProcess, seed: int) -> dict:
    (out,) = prefill.call(pd.run_requests, [prompt(seed)], 1, {"do_remote_decode": True})
    return out


def _free_time(engine: EngineProcess, req: str) -> float | None:
    return next(
        (
            ev["t"]
            for ev in engine.call(pd.take_trace)["events"]
            if ev["kind"] == "free" and ev["req"] == req
        ),
        None,
    )


def test_abort_on_decode_while_the_load_is_in_flight(prefill, decode):
    p_out = _p_prefill(prefill, 28)
    state = decode.call(
        pd.submit_and_abort, prompt(28), D_TOKENS, p_out["kv_transfer_params"], when="loading"
    )
    assert state["status"] == "WAITING_FOR_REMOTE_KVS"
    assert prefill.wait_until(p_request_freed(p_out["request_id"]), FREE_WITHIN_S)
    assert_clean(prefill, decode)
    # D freed the aborted request's blocks: at once if NIXL's read had already reported,
    # else when it did (vLLM delays the free of a load in flight; the receive reaches the
    # scheduler through the composite after request_finished). P was notified by that read.
    d_free = _free_time(decode, state["request_id"])
    p_free = _free_time(prefill, p_out["request_id"])
    assert d_free is not None and d_free > state["t"]
    assert p_free is not None and p_free - state["t"] < FREE_WITHIN_S


def test_abort_on_prefill_after_the_prefill(prefill, decode):
    state = prefill.call(
        pd.submit_and_abort, prompt(29), 4, {"do_remote_decode": True}, when="prefilled"
    )
    assert state["status"] == "RUNNING" and state["computed"] >= PROMPT_LEN
    # aborted, not finished: NIXL does not delay the free and P hands nothing to D
    assert_clean(prefill, timeout=2)
    assert_clean(decode)


def test_decode_aborts_before_scheduling_frees_p(prefill, decode):
    """The router gave up after P's prefill and aborts the hand-off on D: D's NIXL (told by
    the composite's request_finished) notifies P at once, instead of P waiting 300 s."""
    p_out = _p_prefill(prefill, 30)
    state = decode.call(
        pd.submit_and_abort, prompt(30), D_TOKENS, p_out["kv_transfer_params"], when="queued"
    )
    assert state["status"] == "WAITING" and state["steps"] == 0
    freed = prefill.wait_until(p_request_freed(p_out["request_id"]), FREE_WITHIN_S)
    assert freed is not None, "P kept the blocks after D aborted the hand-off"
    assert_clean(prefill, decode)
    decode.call(pd.take_trace)
    prefill.call(pd.take_trace)
