"""kvcompose trees with LMCache in them, on vLLM's real scheduler.

LMCache cannot run on these CPU machines; ``kvcompose.testing.lmcache.LMCacheDouble`` keeps
its adapter's contract (it raises where LMCache asserts: an allocation that is not what it
promised) over an in-process chunk store. The other children are real: vLLM's
``NixlConnector`` (scheduler side) for P/D, a scripted child for a disk tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvcompose.testing.lmcache import LMCacheContractError, cache, lmcache_leaf
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config

pytestmark = pytest.mark.v033

BLOCK = 16
CHUNK = 64


def disk_tier(tokens: int = 0) -> dict[str, Any]:
    script("disk", Behaviour(tokens=tokens))
    return leaf("disk")


def served(h: Any, prompt: list[int]) -> str:
    request = h.add_request(prompt)
    h.run_until_idle()
    assert request.request_id in h.finished
    return request.request_id


def test_chain_lmcache_then_disk_stores_loads_and_cancels(
    harness: Callable[..., Any], harness_factory: Callable[..., Any]
) -> None:
    lmc = cache("lmc", chunk_size=CHUNK)
    tree = chain("tiers", lmcache_leaf("lmc"), disk_tier())
    h = harness(kvcompose_config(tree), enable_prefix_caching=False)
    prompt = h.make_prompt(200, seed=1)

    first = served(h, prompt)
    assert lmc.of("store") == [("store", first, 192)], "whole chunks only"

    second = served(h, prompt)
    assert lmc.of("alloc")[-1] == ("alloc", second, 192), "allocated what it promised"
    assert lmc.of("load") == [("load", second, 192)], "loaded in the step, synchronously"
    assert h.connector.ownership() == {}

    # a longer hit on disk wins under `longest`: LMCache is asked, then told 0 and cancels
    lmc2 = cache("lmc", chunk_size=CHUNK)
    lmc2.store(prompt, last_prefill=True)
    longest = chain("tiers", lmcache_leaf("lmc"), disk_tier(tokens=200), policy="longest")
    h2 = harness(kvcompose_config(longest), enable_prefix_caching=False)
    third = served(h2, prompt)
    assert ("lookup", third, 0, 192) in lmc2.events
    assert ("cancel", third) in lmc2.events
    assert not lmc2.of("load")


def test_lmcache_promise_counts_the_local_prefix_hit(harness: Callable[..., Any]) -> None:
    lmc = cache("lmc", chunk_size=CHUNK)
    h = harness(kvcompose_config(chain("tiers", lmcache_leaf("lmc"), disk_tier())))
    prompt = h.make_prompt(200, seed=2)
    lmc.store(prompt, last_prefill=True)  # 3 chunks: 192 tokens
    served(h, prompt[:80])  # the local prefix cache now holds its 80 tokens (5 blocks)
    request = served(h, prompt)
    assert ("lookup", request, 80, 112) in lmc.events, "promises 192 - 80"
    assert ("alloc", request, 112) in lmc.events
    assert ("load", request, 112) in lmc.events


def test_lmcache_whole_prompt_hit_leaves_the_last_token(harness: Callable[..., Any]) -> None:
    lmc = cache("lmc", chunk_size=CHUNK)
    h = harness(kvcompose_config(chain("tiers", lmcache_leaf("lmc"))), enable_prefix_caching=False)
    prompt = h.make_prompt(192, seed=3)
    lmc.store(prompt, last_prefill=True)
    request = served(h, prompt)
    assert ("lookup", request, 0, 191) in lmc.events
    assert ("alloc", request, 191) in lmc.events  # not what it holds: the check is skipped
    # it retrieves its whole hit (LMCacheConnectorV1Impl.start_load_kv); vLLM computes the
    # last token over it
    assert ("load", request, 192) in lmc.events


def test_the_double_catches_an_allocation_it_did_not_promise(
    harness: Callable[..., Any],
) -> None:
    """The negative control: what LMCache's adapter asserts, the double raises."""
    lmc = cache("lmc", chunk_size=CHUNK)
    h = harness(kvcompose_config(chain("tiers", lmcache_leaf("lmc"))), enable_prefix_caching=False)
    prompt = h.make_prompt(200, seed=4)
    lmc.store(prompt, last_prefill=True)
    child = h.connector.children.connectors[0]
    request = h.add_request(prompt)
    assert child.get_num_new_matched_tokens(request, 0) == (192, False)
    with pytest.raises(LMCacheContractError, match="Mismatch in number of tokens"):
        child.update_state_after_alloc(request, None, 160)
    child.update_state_after_alloc(request, None, 0)  # 0 cancels, whatever was promised
    assert lmc.events[-1] == ("cancel", request.request_id)


NIXL = {"kind": "leaf", "name": "nixl", "connector": "NixlConnector", "extra_config": {}}


def remote_prefill(num_blocks: int) -> dict[str, Any]:
    """What a P/D proxy hands D: NIXL's params for pulling the prompt's KV from P."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": "p-req",
        "remote_block_ids": list(range(1, num_blocks + 1)),
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }


@pytest.mark.parametrize("ask_every_child", [False, True], ids=["kvcompose", "compat"])
def test_pd_decode_with_nixl_then_lmcache_offload(
    harness_factory: Callable[..., Any], ask_every_child: bool
) -> None:
    """D of a P/D pair: NIXL pulls from P (async), LMCache offloads D's KV to CPU. NIXL owns
    a remote prefill; LMCache, told 0, loads nothing (cancelled when it was asked); a
    later request for the same prompt without P is LMCache's."""
    lmc = cache("lmc", chunk_size=CHUNK)
    tree = kvcompose_config(chain("decode", NIXL, lmcache_leaf("lmc")))
    if ask_every_child:
        tree = {
            **tree,
            "kv_connector": "MultiConnector",
            "kv_connector_module_path": "kvcompose.compat",
        }
    h = harness_factory(tree, block_size=BLOCK, enable_prefix_caching=False)
    prompt = h.make_prompt(200, seed=5)
    lmc.store(prompt, last_prefill=True)  # an earlier turn left 192 tokens in LMCache

    pulled = h.add_request(prompt, kv_transfer_params=remote_prefill(13))
    h.step()
    assert h.connector.ownership()[pulled.request_id]["owner"] == "nixl"
    assert h.connector.ownership()[pulled.request_id]["async"] is True
    h.step(finished_recving={pulled.request_id})
    h.run_until_idle()
    assert pulled.request_id in h.finished
    assert not lmc.of("load") and not lmc.of("alloc")
    if ask_every_child:
        assert ("cancel", pulled.request_id) in lmc.events
    else:
        assert not [e for e in lmc.events if e[1] == pulled.request_id]

    local = served(h, prompt)
    assert lmc.of("alloc") == [("alloc", local, 192)]  # no worker here: NIXL's needs KV caches
    assert h.connector.live_requests() == {}
