"""Prefill/decode over real NIXL (UCX, host-memory KV buffers) between two engine processes:
the decode engine's greedy output equals a single engine's, and KV bytes really moved."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(480)]

MAX_TOKENS = 8


def test_nixl_prefill_decode_matches_single_engine(tiny_model):
    pytest.importorskip("nixl")
    from kvcompose.testing.pd import PDPair
    from kvcompose.testing.real_engine import example_prompts, greedy, make_llm

    prompts = example_prompts(2, 200)
    with make_llm(tiny_model) as llm:
        reference = greedy(llm, prompts, MAX_TOKENS)

    with PDPair(tiny_model) as pair:
        decoded, handoff = pair.generate(prompts, MAX_TOKENS)
        assert decoded == reference
        # P handed D a remote prefill for every request.
        for params in handoff:
            assert params is not None and params["do_remote_prefill"] is True
            assert params["remote_block_ids"] and params["remote_engine_id"]

        # P frees its blocks once D has read them.
        assert pair.prefill.wait_idle(timeout=60), "prefill engine kept the request"

        d_stats = pair.decode.stats()
        moved = d_stats["vllm:nixl_bytes_transferred"]
        assert moved["count"] >= len(prompts) and moved["sum"] > 0
        assert d_stats["vllm:nixl_num_failed_transfers"] == 0
        # Every prompt token came from the remote side.
        assert d_stats["vllm:external_prefix_cache_hits"] == 200 * len(prompts)
        print(
            f"NIXL moved {int(moved['sum'])} bytes in {moved['count']} transfers; "
            f"D external prefix hits: {d_stats['vllm:external_prefix_cache_hits']}"
        )
