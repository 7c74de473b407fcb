"""Several real vLLM engines running at once, sharing one Mooncake Store tier.

Each engine is its own process (``EngineProcess``) with its own local tier (a kvcompose
``PrefixStoreConnector`` directory) chained with vLLM's stock ``MooncakeStoreConnector``
over one master and one pool (``kvcompose.testing.mooncake``):

- engine A: ``chain/longest [local_a, shared]``
- engine B: ``chain/stitch [local_b, shared]`` (Mooncake takes part in a stitch as
  ``load_range: native``: looked up at the local tier's end, it loads from there on), its
  shared leaf with an ejection rule (``EJECT``: a lookup slower than 1 s ejects it for 2 s)

Greedy outputs are compared with one engine without any connector. Who loaded what comes
from kvcompose's per-child counters (``hit_tokens.<child>``) and the bytes from Mooncake's
own per-operation counters.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.process import EngineProcess
from kvcompose.testing.mooncake import (
    MooncakeCluster,
    fault_report,
    node_counters,
    remove_all_after_next_hit,
    store_operations,
)
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf, prompt

pytestmark = [pytest.mark.engine, pytest.mark.fleet, pytest.mark.timeout(600)]

BLOCK = 32
MAX_TOKENS = 6
LLM_KWARGS = {"block_size": BLOCK, "enable_prefix_caching": False, "max_model_len": 1024}
#: prompts by name: distinct seeds share no prefix
PROMPTS = {name: prompt(n, seed) for name, n, seed in [
    ("p1", 200, 11), ("p2", 256, 12), ("p3", 256, 13), ("p4", 256, 14),
    ("p5", 256, 15), ("p6", 256, 16), ("neg", 256, 17),
    ("gone", 256, 18),
]}  # fmt: skip
#: the requests in flight when the master is killed, and how many tokens they decode
IN_FLIGHT, LONG = ("p5", "p6"), 64
#: B's shared leaf: ejected from lookups by one slow (or failed) lookup, for 2 s, doubling
EJECT = {"failures": 1, "slow_ms": 1000, "backoff_s": 2}
#: fresh prompts for the rounds after the master came back (one per round)
AFTER = [f"after{i}" for i in range(8)]
PROMPTS.update({name: prompt(256, 30 + i) for i, name in enumerate(AFTER)})
#: a 256-token prompt: 7 full blocks inside prompt[:-1] (what a lookup may offer); the
#: first 100 tokens: 3. Mooncake saves every full block the prompt computed: 8.
FULL, SHORT, SAVED = 7 * BLOCK, 3 * BLOCK, 256 // BLOCK


def stored_tokens(n: int) -> int:
    """What a store can offer of an ``n``-token prompt: the full blocks inside prompt[:-1]."""
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory) -> dict[str, list[int]]:
    """Every prompt's greedy output from one engine without any connector."""
    log = tmp_path_factory.mktemp("reference") / "engine.log"
    # no Mooncake in this one: it may fork from the server that has imported vLLM once
    with EngineProcess(
        model, None, name="reference", llm_kwargs=LLM_KWARGS, log_file=log, preloaded=True
    ) as engine:
        outs = engine.generate(list(PROMPTS.values()), MAX_TOKENS)
        ref = {name: out[0] for name, out in zip(PROMPTS, outs, strict=True)}
        for name in IN_FLIGHT:  # the requests the master dies under decode this long
            ref[f"{name}-long"] = engine.generate([PROMPTS[name]], LONG)[0][0]
    return ref


@pytest.fixture(scope="module")
def engines(cluster: MooncakeCluster, model: Path, tmp_path_factory) -> dict[str, EngineProcess]:
    """Engines A (longest) and B (stitch), running side by side for the whole module."""
    tmp = tmp_path_factory.mktemp("local")
    out = {}
    for name, policy, shared_fields in [
        ("a", "longest", {}),
        ("b", "stitch", {"load_range": "native", "eject": EJECT}),
    ]:
        tree = chain(
            "tiers",
            prefix_store_leaf("local", tmp / name),
            cluster.leaf("shared", fields=shared_fields),
            policy=policy,
        )
        cfg = kvcompose_config(tree, kv_load_failure_policy="recompute")
        out[name] = cluster.engine(name, model, cfg, llm_kwargs=LLM_KWARGS, wait=False)
    for engine in out.values():  # started side by side; the cluster stops them all
        engine.wait_started()
    return out


def run(
    engine: EngineProcess, name: str, n: int | None = None, max_tokens: int = MAX_TOKENS
) -> list[int]:
    """Greedy output of prompt ``name`` (its first ``n`` tokens) on ``engine``."""
    tokens = PROMPTS[name] if n is None else PROMPTS[name][:n]
    return engine.generate([tokens], max_tokens)[0][0]


def wait_keys(cluster: MooncakeCluster, at_least: int, timeout: float = 30.0) -> int:
    """Wait until the master holds ``at_least`` keys (saves are put in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        n = len(cluster.keys())
        if n >= at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _loaded(llm: Any) -> dict[str, float]:
    """(In the engine) Mooncake's load totals: keys and bytes read from the pool."""
    ops = store_operations(llm)
    return {
        k: sum(v[k] for op, v in ops.items() if op.startswith("load")) for k in ("keys", "bytes")
    }


def test_b_loads_a_prefix_from_the_shared_tier_while_both_run(engines, empty_store, reference):
    a, b = engines["a"], engines["b"]
    assert run(a, "p1") == reference["p1"]  # computes and saves to its local tier and Mooncake
    blocks = stored_tokens(len(PROMPTS["p1"])) // BLOCK
    assert wait_keys(empty_store, blocks) == blocks  # one key per block (all layers)

    before, load_before = b.call(node_counters), b.call(_loaded)
    assert run(b, "p1") == reference["p1"]
    hits, load = diff(b.call(node_counters), before), diff(b.call(_loaded), load_before)
    # B's local tier is empty: the whole prefix came from the shared tier
    assert hits.get("hit_tokens.shared") == stored_tokens(len(PROMPTS["p1"]))
    assert "hit_tokens.local" not in hits
    assert load.get("keys") == blocks and load.get("bytes", 0) > 0
    print(f"\nB loaded {load} from Mooncake; kvcompose: {hits}")


def test_stitch_local_prefix_from_local_the_rest_from_mooncake(engines, empty_store, reference):
    a, b = engines["a"], engines["b"]
    run(b, "p2", 100)  # B's local tier (and Mooncake) get the first 3 blocks
    assert run(a, "p2") == reference["p2"]  # Mooncake gets all 7 blocks
    assert wait_keys(empty_store, SAVED) == SAVED

    before, load_before = b.call(node_counters), b.call(_loaded)
    assert run(b, "p2") == reference["p2"]
    hits, load = diff(b.call(node_counters), before), diff(b.call(_loaded), load_before)
    # stitched: B's local tier loads its 96 tokens, Mooncake only the 128 after them
    assert hits.get("hit_tokens.local") == SHORT
    assert hits.get("hit_tokens.shared") == FULL - SHORT
    assert load.get("keys") == (FULL - SHORT) // BLOCK  # Mooncake read 4 blocks, not 7
    print(f"\nstitch on B: kvcompose {hits}; Mooncake read {load}")


def test_longest_takes_the_longer_tier_and_the_local_one_on_a_tie(engines, empty_store, reference):
    a, b = engines["a"], engines["b"]
    # p3: A's local tier holds 3 blocks, Mooncake all 7 (B ran it whole)
    run(a, "p3", 100)
    assert run(b, "p3") == reference["p3"]
    assert wait_keys(empty_store, SAVED) == SAVED
    before, load_before = a.call(node_counters), a.call(_loaded)
    assert run(a, "p3") == reference["p3"]
    hits, load = diff(a.call(node_counters), before), diff(a.call(_loaded), load_before)
    assert hits.get("hit_tokens.shared") == FULL and "hit_tokens.local" not in hits
    assert load.get("keys") == FULL // BLOCK

    # p4: A ran it whole, so both tiers hold all 7 blocks: the tie goes to the first child
    assert run(a, "p4") == reference["p4"]
    assert wait_keys(empty_store, 2 * SAVED) == 2 * SAVED
    before, load_before = a.call(node_counters), a.call(_loaded)
    assert run(a, "p4") == reference["p4"]
    hits, load = diff(a.call(node_counters), before), diff(a.call(_loaded), load_before)
    assert hits.get("hit_tokens.local") == FULL and "hit_tokens.shared" not in hits
    assert not load.get("keys")


def test_negative_control_corrupted_shared_blocks_change_the_output(
    engines, empty_store, reference
):
    """The shared tier's blocks overwritten with noise: B still loads them (same hit), and
    its output changes, so the outputs above come from the KV Mooncake served."""
    a, b = engines["a"], engines["b"]
    assert run(a, "neg") == reference["neg"]
    assert wait_keys(empty_store, SAVED) == SAVED
    assert empty_store.corrupt() == SAVED
    before = b.call(node_counters)
    out = run(b, "neg")
    hits = diff(b.call(node_counters), before)
    assert hits.get("hit_tokens.shared") == FULL, hits
    assert out != reference["neg"], "B's output ignored the KV it loaded from Mooncake"


def test_blocks_removed_between_lookup_and_load_are_recomputed(engines, empty_store, reference):
    """A's lookup finds B's 7 blocks in the shared tier; every object is removed before A's
    worker loads them. The load fails, vLLM recomputes (``kv_load_failure_policy:
    recompute``), and the output is recompute's."""
    cluster = empty_store
    a, b = engines["a"], engines["b"]
    assert run(b, "gone") == reference["gone"]
    assert wait_keys(cluster, SAVED) == SAVED
    a.call(
        remove_all_after_next_hit,
        "shared",
        cluster.metadata_url,
        cluster.master_address,
        cluster.keys_url,
    )
    before, ops_before = a.call(node_counters), a.call(store_operations)
    assert run(a, "gone") == reference["gone"]
    report = a.call(fault_report)
    hits = diff(a.call(node_counters), before)
    ops = {
        op: diff(v, ops_before.get(op, {}))
        for op, v in a.call(store_operations).items()
        if diff(v, ops_before.get(op, {}))
    }
    print(f"\nremoved after the lookup: {report}; A's counters {hits}; Mooncake ops {ops}")
    assert (report["hit"], report["removed"], report["left"]) == (FULL, SAVED, 0)
    assert hits.get("hit_tokens.shared") == FULL  # the lookup's hit, which then failed
    loads = {op: v for op, v in ops.items() if op.startswith("load")}
    assert loads and not any(op.endswith("/ok") for op in loads), loads  # the load failed
    # recomputed, then saved again: the master holds the keys once A's background put is
    # done (A's own put counters can still lag when its request returns)
    assert wait_keys(cluster, SAVED) == SAVED


def test_master_killed_mid_run_requests_finish_and_hits_come_back(engines, empty_store, reference):
    """The master dies (SIGKILL) while both engines have a request in flight: every
    request finishes with the output of recompute (the leaf's ``on_error: miss``, vLLM's
    ``kv_load_failure_policy: recompute``), nothing hangs. B's shared leaf, whose lookup now
    waits on the dead master (Mooncake's client answers a miss after its own timeout), is
    ejected by its rule, and B's next requests skip it. Once the master is back (same ports,
    no key: its metadata died with it), the pool re-mounts its segment, the engines' clients
    reconnect, B's leaf answers its trial lookup in time and is let back in, and a prefix A
    stores is loaded by B again."""
    cluster = empty_store
    a, b = engines["a"], engines["b"]
    assert run(a, "p5") == reference["p5"]
    assert wait_keys(cluster, SAVED) == SAVED

    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def worker(engine: EngineProcess, name: str) -> None:
        try:
            results[name] = run(engine, name, max_tokens=LONG)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    # in flight when the kill lands: B's p5 is a shared hit, A's p6 is new; both decode 64
    # tokens, so the kill lands during the request (where exactly is not pinned: lookup,
    # load, save or decode)
    threads = [threading.Thread(target=worker, args=(e, n)) for e, n in [(b, "p5"), (a, "p6")]]
    for t in threads:
        t.start()
    time.sleep(0.05)
    cluster.kill_master()
    t0 = time.monotonic()
    in_flight = sum(t.is_alive() for t in threads)
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a request hangs after the master died"
    assert not errors, errors
    assert results == {"p5": reference["p5-long"], "p6": reference["p6-long"]}

    # with the master gone: lookups miss and saves fail, requests still finish; B's first
    # lookup there is slow (or fails), which ejects its shared leaf, so the ones after it
    # skip the leaf
    before = start = b.call(node_counters)
    t1 = time.monotonic()
    assert run(b, "p6") == reference["p6"]  # nowhere B can reach: a miss, computed
    assert run(b, "p5") == reference["p5"]  # B's local tier saved it in the run above
    assert run(b, "p4") == reference["p4"]
    down = time.monotonic() - t1
    hits = diff(b.call(node_counters), before)
    assert "hit_tokens.shared" not in hits, hits
    assert hits.get("ejections.shared", 0) >= 1, f"the dead master's leaf was not ejected: {hits}"
    assert hits.get("ejected_lookups.shared", 0) >= 1, hits
    print(f"\nmaster down: {in_flight} of 2 requests still running at the kill, done "
          f"{t1 - t0:.1f} s after it; "
          f"two more requests on B took {down:.1f} s; B's counters {hits}")  # fmt: skip

    cluster.start_master()
    cluster.wait_pool_mounted()
    t2 = time.monotonic()
    # The engines' clients reconnect on their own; a client's first calls after the restart
    # may still fail. Each round A computes a fresh prompt (saved to both tiers) and B, whose
    # local tier lacks it, looks it up; the hit is back once a round loads from Mooncake.
    rounds = []
    for name in AFTER:
        keys = len(cluster.keys())
        assert run(a, name) == reference[name]
        saved = wait_keys(cluster, keys + SAVED, timeout=10) - keys
        before = b.call(node_counters)
        assert run(b, name) == reference[name]
        hits = diff(b.call(node_counters), before)
        rounds.append((name, saved, hits.get("hit_tokens.shared", 0)))
        if hits.get("hit_tokens.shared") == FULL:
            break
        if time.monotonic() - t2 > 90:
            break
    back = diff(b.call(node_counters), start)
    print(f"master back: rounds (prompt, blocks A saved, tokens B loaded) {rounds}, "
          f"{time.monotonic() - t2:.1f} s; B's counters {back}")  # fmt: skip
    assert rounds[-1][2] == FULL, f"no hit from the restarted master: {rounds}"
    assert back.get("readmissions.shared", 0) >= 1, back
