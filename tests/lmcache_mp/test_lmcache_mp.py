"""LMCache's multi-process mode on real engines: vLLM's ``LMCacheMPConnector`` against one
``lmcache server``, given to vLLM directly and as a leaf of kvcompose trees.

Engines, all running for the whole module, one server:

- ``reference``: no connector (recompute);
- ``a``, ``b``: ``LMCacheMPConnector`` given to vLLM directly;
- ``longest``, ``first``, ``stitch``: ``chain [store, lmcache]`` with that policy, each with
  a local ``PrefixStoreConnector`` directory of its own, the LMCache leaf ``on_error: miss``,
  a lookup timeout of 30 s and vLLM's ``kv_load_failure_policy: recompute``;
- ``prefill``, ``decode`` (started for the P/D test): vLLM's ``NixlConnector`` on P;
  ``chain longest [nixl, lmcache]`` on D, NIXL first as docs/lmcache.md recommends.

The test that kills the server runs after the others that need the server (the engines given
LMCache directly do not recover).

A prompt is 256 tokens (8 blocks of 32, 4 LMCache chunks of 64) unless said otherwise:
LMCache finds the whole prompt and loads 255 tokens (vLLM computes the last one), the store
finds the 7 blocks inside ``prompt[:-1]``. Who loaded what comes from vLLM's
``external_prefix_cache_hits`` and kvcompose's per-child counters (``hit_tokens.<child>``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.process import EngineProcess
from kvcompose.testing import pd as pd_bed
from kvcompose.testing.lmcache_engine import (
    corrupt_after_next_load,
    corruption_report,
    external_hit_tokens,
)
from kvcompose.testing.lmcache_server import CLIENT_HEARTBEAT_S, LMCacheServer, lmcache_missing
from kvcompose.testing.mooncake import node_counters
from kvcompose.testing.ports import free_port
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

pytestmark = [pytest.mark.engine, pytest.mark.lmcache, pytest.mark.timeout(600)]

BLOCK = 32  # LMCache's chunk (the server fixture's) is two blocks
LLM_KWARGS = {"block_size": BLOCK, "enable_prefix_caching": False, "max_model_len": 1024}

MAX_TOKENS = 6
#: prompts by name; distinct seeds share no prefix. "tie" is 200 tokens: the store finds the
#: 6 blocks inside prompt[:-1] (192 tokens), LMCache its 3 whole chunks (192 tokens).
PROMPTS = {name: prompt(n, seed) for name, n, seed in [
    ("direct", 256, 41), ("neg", 256, 42), ("leaf", 256, 43), ("leaf-neg", 256, 44),
    ("tie", 200, 45), ("first", 256, 46), ("first2", 256, 47), ("stitch", 256, 48),
    ("pd", 256, 49), ("pd2", 256, 50), ("kill", 256, 51), ("down", 256, 52),
]}  # fmt: skip
PROMPTS["stitch-head"] = PROMPTS["stitch"][:100]
#: fresh prompts for the rounds after the server came back
AFTER = [f"after{i}" for i in range(24)]
PROMPTS.update({name: prompt(256, 60 + i) for i, name in enumerate(AFTER)})
#: what LMCache loads of a 256-token prompt it holds whole; what the store loads of it
WHOLE, STORE = 255, 7 * BLOCK
#: decode this long while the server is killed
LONG = 48
#: seconds a kvcompose node waits for a child answering "still looking": long, because in
#: the module's first tests, right after six engines registered with the server, LMCache's
#: lookups took seconds to answer (2.7 s on average, one over 5 s, on 2 cores); a deadline
#: the server misses drops LMCache from that decision, and the test then sees a miss
LOOKUP_TIMEOUT_S = 30.0
#: how long the killed server stays down: two heartbeats of the engines' LMCache clients and
#: some slack, so each client's heartbeat sees it down and registers again once it is back
DOWN_S = 2 * CLIENT_HEARTBEAT_S + 5.0


@pytest.fixture(scope="module")
def engines(server: LMCacheServer, model: Path, tmp_path_factory) -> dict[str, EngineProcess]:
    """The module's engines, started side by side; the server's ``stop`` ends them all."""
    tmp = tmp_path_factory.mktemp("stores")
    lmcache = server.leaf("lmcache", fields={"on_error": "miss"})
    configs: dict[str, dict[str, Any] | None] = {
        "reference": None,
        "a": server.connector_config(),
        "b": server.connector_config(),
    }
    for policy in ("longest", "first", "stitch"):
        tree = chain(
            "tiers", prefix_store_leaf("store", tmp / policy), lmcache,
            policy=policy, lookup_timeout_s=LOOKUP_TIMEOUT_S,
        )  # fmt: skip
        configs[policy] = kvcompose_config(tree, kv_load_failure_policy="recompute")
    out = {
        name: server.engine(name, model, cfg, llm_kwargs=LLM_KWARGS, wait=False)
        for name, cfg in configs.items()
    }
    for engine in out.values():
        engine.wait_started()
    return out


@pytest.fixture(scope="module")
def reference(engines: dict[str, EngineProcess]) -> dict[str, list[int]]:
    """Every prompt's greedy output, computed by the engine without a connector."""
    outs = engines["reference"].generate(list(PROMPTS.values()), MAX_TOKENS)
    ref = {name: out[0] for name, out in zip(PROMPTS, outs, strict=True)}
    ref["kill-long"] = engines["reference"].generate([PROMPTS["kill"]], LONG)[0][0]
    return ref


@pytest.fixture(scope="module")
def pd(server: LMCacheServer, model: Path, engines) -> dict[str, pd_bed.EngineProcess]:
    """A prefill engine (NIXL) and a decode engine (``chain longest [nixl, lmcache]``),
    started after the module's other engines (the server stops them all)."""
    nixl = {"kind": "leaf", "name": "nixl", "connector": "NixlConnector",
            "kv_buffer_device": "cpu", "extra_config": {"backends": ["UCX"]}}  # fmt: skip
    lmcache = server.leaf("lmcache", fields={"on_error": "miss"})
    decode = chain("decode", nixl, lmcache, policy="longest")
    configs = {
        "prefill": pd_bed.NIXL_CPU_CONFIG,
        "decode": kvcompose_config(decode, kv_load_failure_policy="recompute"),
    }
    out = {
        name: server.engine(
            name, model, cfg, llm_kwargs=LLM_KWARGS, wait=False, engine_class=pd_bed.EngineProcess,
            env=pd_bed.engine_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
        )
        for name, cfg in configs.items()
    }  # fmt: skip
    for engine in out.values():
        engine.wait_started()
    return out


#: the module's server (set by ``_module_server``), whose commits ``generate`` waits for
SERVER: list[LMCacheServer] = []


@pytest.fixture(scope="module", autouse=True)
def _module_server(server: LMCacheServer) -> Iterator[None]:
    SERVER.append(server)
    yield
    SERVER.remove(server)


def generate(engine: EngineProcess, name: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy output of prompt ``name``, once the engine's saves of it are done and visible:
    LMCache holds a finished request's blocks until its server has stored them
    (``request_finished`` returns True), and the engine steps on while idle until then; the
    server acknowledges the store before it commits the chunks, which a lookup needs (seen:
    a lookup 0.2 s after the save missed a chunk it stored). While the server is down there is
    nothing to wait for."""
    tokens = engine.generate([PROMPTS[name]], max_tokens)[0][0]
    assert engine.wait_idle(60), f"{engine.name}: the saves of {name!r} never finished"
    for server in SERVER:
        assert server.wait_writes_committed(30), (
            f"{engine.name}: the server never committed the saves of {name!r}: {server.writes()}"
        )
    return tokens


def run(engine: EngineProcess, name: str) -> tuple[list[int], int]:
    """Greedy output of prompt ``name`` on ``engine``, and the tokens it loaded for it."""
    before = engine.call(external_hit_tokens)
    tokens = generate(engine, name)
    return tokens, int(engine.call(external_hit_tokens) - before)


def hits(engine: EngineProcess, run_it: str) -> tuple[list[int], dict[str, float]]:
    """Greedy output of prompt ``run_it`` on a kvcompose engine, and its per-child hit
    tokens for it."""
    before = engine.call(node_counters)
    tokens = generate(engine, run_it)
    after = engine.call(node_counters)
    return tokens, {
        k.removeprefix("hit_tokens."): v - before.get(k, 0)
        for k, v in after.items()
        if k.startswith("hit_tokens.") and v != before.get(k, 0)
    }


def test_a_second_engine_loads_the_prefix_the_first_stored(server, engines, reference):
    """LMCache given to vLLM directly: A computes and stores, B loads it all (255 of 256
    tokens) from the server with recompute's output. The bed counted A's 4 chunks into
    their commit and out of it (what ``generate`` waits for)."""
    a, b = engines["a"], engines["b"]
    handed, _ = server.writes()
    assert run(a, "direct") == (reference["direct"], 0)
    assert server.writes() == (handed + 256 // (2 * BLOCK),) * 2
    assert run(b, "direct") == (reference["direct"], WHOLE)


def test_negative_control_noise_in_the_loaded_blocks_changes_the_output(engines, reference):
    """B loads what A stored, and its blocks are overwritten with noise right after the
    load: the output changes, so B's output above came from the KV it loaded."""
    a, b = engines["a"], engines["b"]
    assert run(a, "neg") == (reference["neg"], 0)
    b.call(corrupt_after_next_load)
    tokens, loaded = run(b, "neg")
    assert loaded == WHOLE
    assert list(b.call(corruption_report).values()) == [256 // BLOCK]
    assert tokens != reference["neg"]


def test_as_a_kvcompose_leaf_it_loads_what_a_direct_engine_stored_and_back(engines, reference):
    """The LMCache leaf of a kvcompose chain loads the prefix a direct engine stored, and
    stores what it computes for a direct engine to load: same keys, same server."""
    a, b, tree = engines["a"], engines["b"], engines["longest"]
    assert run(a, "leaf") == (reference["leaf"], 0)
    assert hits(tree, "leaf") == (reference["leaf"], {"lmcache": WHOLE})
    tokens, by_child = hits(tree, "first")  # computed by the tree: stored in both tiers
    assert (tokens, by_child) == (reference["first"], {})
    assert run(b, "first") == (reference["first"], WHOLE)


def test_negative_control_as_a_leaf(engines, reference):
    a, tree = engines["a"], engines["longest"]
    assert run(a, "leaf-neg") == (reference["leaf-neg"], 0)
    tree.call(corrupt_after_next_load)
    tokens, by_child = hits(tree, "leaf-neg")
    assert by_child == {"lmcache": WHOLE}
    assert tokens != reference["leaf-neg"]


def test_longest_tie_goes_to_the_store_and_lmcache_saves_through(engines, reference):
    """A 200-token prompt: the store finds 6 blocks (192 tokens), LMCache 3 chunks (192
    tokens). The chain computed it and saved it to both; on the tie the earlier child, the
    store, loads, and LMCache holds it too: a direct engine loads it from there."""
    tree, b = engines["longest"], engines["b"]
    assert hits(tree, "tie") == (reference["tie"], {})
    assert hits(tree, "tie") == (reference["tie"], {"store": 192})
    assert run(b, "tie") == (reference["tie"], 192)


def test_stitch_store_head_then_lmcache_from_a_block_inside_its_chunk(engines, reference):
    """``stitch [store, lmcache]``: the store holds the first 3 blocks (96 tokens), LMCache
    the whole prompt. LMCache, native from any block boundary, loads [96, 255): its
    retrieve starts at its chunk floor (64) and skips what lies before 96."""
    a, tree = engines["a"], engines["stitch"]
    # the first 100 tokens: the store saves 3 blocks, LMCache 1 chunk
    assert hits(tree, "stitch-head") == (reference["stitch-head"], {})
    assert run(a, "stitch") == (reference["stitch"], 64)  # LMCache now holds all 4 chunks
    assert hits(tree, "stitch") == (reference["stitch"], {"store": 96, "lmcache": WHOLE - 96})


def test_pd_over_nixl_with_lmcache_on_the_decode_side(engines, pd, reference):
    """D runs ``chain longest [nixl, lmcache]``. With P's hand-off NIXL owns the whole
    prompt (256 tokens, longer than LMCache's 255) even when LMCache holds it too (LMCache is
    told 0); without one, NIXL has nothing and LMCache serves the prefix another engine
    stored."""
    a = engines["a"]
    assert run(a, "pd") == (reference["pd"], 0)  # LMCache holds "pd" too
    handoff = pd["prefill"].generate([PROMPTS["pd"]], 1, {"do_remote_decode": True})[0][1]
    before = pd["decode"].call(node_counters)
    tokens = pd["decode"].generate([PROMPTS["pd"]], MAX_TOKENS, handoff)[0][0]
    after = pd["decode"].call(node_counters)
    assert tokens == reference["pd"]
    assert after.get("hit_tokens.nixl", 0) - before.get("hit_tokens.nixl", 0) == 256
    assert after.get("hit_tokens.lmcache", 0) == before.get("hit_tokens.lmcache", 0)
    assert pd["prefill"].wait_idle(60), "P still holds the request after D pulled it"

    assert run(a, "pd2") == (reference["pd2"], 0)
    assert hits(pd["decode"], "pd2") == (reference["pd2"], {"lmcache": WHOLE})


def test_first_takes_the_first_child_with_a_hit_and_the_store_saves_through(engines, reference):
    """``first [store, lmcache]``: a prefix only LMCache holds is loaded from LMCache and
    saved through to the store; the next time the store, asked first, owns it although
    LMCache's hit is longer (255 against 224 tokens). LMCache is asked after the store's hit
    too (it asserts on a request it was never asked about). No other test uses the ``first``
    engine (a failing step leaves it unusable)."""
    a, tree = engines["a"], engines["first"]
    assert run(a, "first2") == (reference["first2"], 0)
    assert hits(tree, "first2") == (reference["first2"], {"lmcache": WHOLE})
    assert hits(tree, "first2") == (reference["first2"], {"store": STORE})


def test_server_killed_inside_a_load_request_finishes_and_hits_come_back(
    server, engines, reference
):
    """The server dies (SIGKILL) while it holds an engine's retrieve: the lookup answered a
    hit, the load is in flight (the bed's hook, ``LMCacheServer.hold_retrieves``, keeps
    LMCache's ``LMCacheDrivenTransferModule.retrieve`` from answering until the kill; the
    test asserts the retrieve arrived first). The request finishes with recompute's output:
    the client's heartbeat (``CLIENT_HEARTBEAT_S``) marks the server unhealthy, and
    ``LMCacheMPWorkerAdapter.get_finished`` then reports the pending retrieve finished with
    its blocks failed (``kv_load_failure_policy: recompute``); nothing hangs. A request
    while the server is down, its client unhealthy by then, computes (``on_error: miss``);
    once the server is back (same ports, empty, ``DOWN_S`` after the kill), a prefix one
    chain stores is loaded by another again. Back sooner, it could stay unnoticed by a
    client whose heartbeat never saw it down; that engine never registers again and the new
    server refuses its saves (``CLIENT_HEARTBEAT_S``)."""
    tree, other = engines["longest"], engines["stitch"]
    assert hits(tree, "kill") == (reference["kill"], {})  # stored in LMCache (and its store)
    result: list[Any] = []

    def in_flight() -> None:
        try:
            result.append(generate(other, "kill", LONG))
        except BaseException as exc:  # re-raised below, in the test's thread
            result.append(exc)

    server.hold_retrieves()
    thread = threading.Thread(target=in_flight)
    thread.start()
    held = server.wait_held_retrieve(60)
    server.kill()
    t_kill = time.monotonic()
    thread.join(timeout=240)
    done_s = time.monotonic() - t_kill
    assert held, f"the server never received the request's retrieve: {result}"
    assert not thread.is_alive(), "a request hangs after the server died inside its load"
    assert result == [reference["kill-long"]]

    t0 = time.monotonic()
    assert hits(other, "down") == (reference["down"], {})  # nowhere to look: computed
    down_s = time.monotonic() - t0

    time.sleep(max(0.0, t_kill + DOWN_S - time.monotonic()))
    down_total_s = time.monotonic() - t_kill
    server.restart()
    t1 = time.monotonic()
    rounds = []
    # the engines' clients register their KV caches with the new server on their next
    # heartbeat (stores from an engine not yet registered are refused): each round one
    # chain computes a fresh prompt, the other looks it up, until it loads it
    for name in AFTER:
        assert hits(tree, name) == (reference[name], {})
        tokens, by_child = hits(other, name)
        assert tokens == reference[name]
        rounds.append(by_child)
        if by_child.get("lmcache") == WHOLE or time.monotonic() - t1 > 90:
            break
        time.sleep(2)
    print(f"\nserver killed inside the load of {held}: the request done (saves included) "
          f"{done_s:.1f} s "
          f"later; a request while down took {down_s:.1f} s; down {down_total_s:.1f} s; "
          f"after the restart, {time.monotonic() - t1:.1f} s: {rounds}")  # fmt: skip
    assert rounds[-1] == {"lmcache": WHOLE}, rounds


def test_the_heartbeat_the_kill_test_waits_out_is_lmcache_s() -> None:
    """``CLIENT_HEARTBEAT_S`` (which ``DOWN_S`` doubles) is the installed LMCache client's
    default heartbeat interval (read in a process of its own: importing LMCache here would
    load torch and LMCache's logging into the test process)."""
    missing = lmcache_missing()
    if missing:
        pytest.skip(f"LMCache cannot run here: {missing}")
    code = (
        "from lmcache.integration.vllm.vllm_multi_process_adapter import "
        "ExtraConfigDefault as d; print(d.heartbeat_interval.default)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == CLIENT_HEARTBEAT_S
