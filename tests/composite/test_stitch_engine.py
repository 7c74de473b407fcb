"""``policy: stitch`` on a real engine: two PrefixStoreConnector tiers with different coverage.

The fast tier (sync) holds each prompt's first 96 tokens, the slow tier (async) the whole
prompt. Stitched, the fast tier loads its 96 tokens and the slow tier only the 128 after them
(the slow tier's lookup starts at the fast tier's end); greedy outputs equal a run without
any connector; the worker's per-tier counters show the tokens and bytes each tier read. A
failed slow segment keeps the fast one, or, with a third tier holding the gap, is reloaded
from it while the request is still parked.
"""

from __future__ import annotations

import shutil
from collections import Counter
from typing import Any

import pytest

from kvcompose.engine.llm import generate_by_id
from kvcompose.engine.probe import scheduler
from kvcompose.introspect import node_stats, scheduler_connector
from kvcompose.testing import faulty_store
from kvcompose.testing.real_engine import make_llm
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32
PROMPT = 256
FAST_PROMPT = 100  # saves chunks 0..2: the first 96 tokens of the full prompt
FAST = 96
#: what a lookup may offer of a 256-token prompt: chunks inside prompt[:-1]
OFFERED = (PROMPT - 1) // BLOCK * BLOCK


def run(llm: Any, requests: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    outputs = generate_by_id(llm, requests.items(), max_tokens)
    return {req_id: list(out.outputs[0].token_ids) for req_id, out in outputs.items()}


def _tier_totals(worker: Any) -> dict[str, dict[str, Any]]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    root = get_kv_transfer_group()
    return {c.name: dict(c.connector.total_stats.data) for c in root.children}


def tier_totals(llm: Any) -> dict[str, dict[str, Any]]:
    """Each tier's cumulative worker-side counters (tokens, bytes loaded and saved)."""
    return llm.collective_rpc(_tier_totals)[0]


def slow_failing_r0(filled: dict[str, Any]) -> dict[str, Any]:
    """The slow tier whose loads of r0 fail (the store with a fault switch, a subclass the
    range table does not know by name, so it says it is native)."""
    return prefix_store_leaf(
        "slow",
        filled["slow"],
        read_only=True,
        load_mode="async",
        fail_load_request_ids=["r0"],
        fields={
            "connector": faulty_store.CONNECTOR,
            "module_path": faulty_store.MODULE_PATH,
            "load_range": "native",
        },
    )


def count_computed(llm: Any) -> Counter[str]:
    """Tokens the model computes from now on, per request id as the client chose it (the
    engine's scheduler is wrapped; vLLM appends ``-<suffix>`` to the id)."""
    computed: Counter[str] = Counter()
    sched = scheduler(llm)
    schedule = sched.schedule

    def counting_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        for req_id, n in out.num_scheduled_tokens.items():
            computed[req_id.rsplit("-", 1)[0]] += n
        return out

    sched.schedule = counting_schedule
    return computed


@pytest.fixture(scope="module")
def filled(tiny_model, tmp_path_factory) -> dict[str, Any]:
    """The reference outputs, and the two tiers filled: slow with whole prompts, fast with
    their first 96 tokens."""
    tmp = tmp_path_factory.mktemp("tiers")
    requests = {f"r{k}": [4 + (97 * k + 13 * i) % 1000 for i in range(PROMPT)] for k in range(2)}
    fast, slow = tmp / "fast", tmp / "slow"
    # the reference run saves every prompt to the slow tier (saving changes no output)
    with make_llm(tiny_model, kvcompose_config(prefix_store_leaf("slow", slow)), **KW) as llm:
        baseline = run(llm, requests)
    with make_llm(tiny_model, kvcompose_config(prefix_store_leaf("fast", fast)), **KW) as llm:
        run(llm, {k: v[:FAST_PROMPT] for k, v in requests.items()}, 1)
    return {"requests": requests, "baseline": baseline, "fast": fast, "slow": slow}


KW = {"block_size": BLOCK, "enable_prefix_caching": False}


def test_stitch_reads_the_slow_tier_only_for_the_gap(tiny_model, filled):
    requests = filled["requests"]
    tree = kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf("fast", filled["fast"], read_only=True),
            prefix_store_leaf("slow", filled["slow"], read_only=True, load_mode="async"),
            policy="stitch",
        ),
        kv_load_failure_policy="recompute",
    )
    with make_llm(tiny_model, tree, **KW) as llm:
        assert run(llm, requests) == filled["baseline"]
        tiers = tier_totals(llm)
        counters = node_stats(llm)["counters"]
        assert scheduler_connector(llm).live_requests() == {}
    n = len(requests)
    assert counters["hit_tokens.fast"] == n * FAST
    assert counters["hit_tokens.slow"] == n * (OFFERED - FAST)
    assert tiers["fast"]["tokens_loaded"] == n * FAST
    assert tiers["slow"]["tokens_loaded"] == n * (OFFERED - FAST)
    # bytes follow tokens: the slow tier read only the gap
    per_token = tiers["fast"]["bytes_loaded"] / tiers["fast"]["tokens_loaded"]
    assert tiers["slow"]["bytes_loaded"] == pytest.approx(per_token * n * (OFFERED - FAST))
    print(
        f"\nstitch: fast read {tiers['fast']['tokens_loaded']} tokens "
        f"({tiers['fast']['bytes_loaded']} B), slow {tiers['slow']['tokens_loaded']} tokens "
        f"({tiers['slow']['bytes_loaded']} B); longest would read {n * OFFERED} tokens "
        "from the slow tier"
    )


def test_a_failed_slow_segment_keeps_the_fast_one(tiny_model, filled):
    """r0's slow segment fails (fault injection): vLLM keeps the fast tier's 96 tokens and
    recomputes only the rest; outputs still equal the reference."""
    requests = filled["requests"]
    tree = kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf("fast", filled["fast"], read_only=True),
            slow_failing_r0(filled),
            policy="stitch",
        ),
        kv_load_failure_policy="recompute",
    )
    with make_llm(tiny_model, tree, **KW) as llm:
        computed = count_computed(llm)
        assert run(llm, requests, max_tokens=6) == filled["baseline"]
        tiers = tier_totals(llm)
        counters = node_stats(llm)["counters"]
        assert scheduler_connector(llm).live_requests() == {}
    decode = 6 - 1  # the last prompt step samples the first token
    assert computed["r1"] == PROMPT - OFFERED + decode
    assert computed["r0"] == PROMPT - FAST + decode  # only the failed segment and the rest
    n = len(requests)
    assert tiers["fast"]["tokens_loaded"] == n * FAST
    assert tiers["slow"]["load_failures"] == 1
    # no re-lookup: r0 kept its fast segment, so neither tier was asked again
    assert counters["hits.fast"] == n and counters["hits.slow"] == n


def test_a_failed_slow_segment_is_reloaded_from_a_third_tier(tiny_model, filled, tmp_path):
    """r0's slow segment fails; a third tier (a copy of the slow one) holds the gap: while r0
    is still parked it reloads exactly that segment's tokens, so nothing is recomputed and
    outputs equal the reference."""
    requests = filled["requests"]
    backup = tmp_path / "backup"
    shutil.copytree(filled["slow"], backup)
    tree = kvcompose_config(
        chain(
            "tiers",
            prefix_store_leaf("fast", filled["fast"], read_only=True),
            slow_failing_r0(filled),
            prefix_store_leaf("backup", backup, read_only=True, load_mode="async"),
            policy="stitch",
        ),
        kv_load_failure_policy="recompute",
    )
    with make_llm(tiny_model, tree, **KW) as llm:
        computed = count_computed(llm)
        assert run(llm, requests, max_tokens=6) == filled["baseline"]
        tiers = tier_totals(llm)
        counters = node_stats(llm)["counters"]
        assert scheduler_connector(llm).live_requests() == {}
    decode = 6 - 1
    gap = OFFERED - FAST
    assert computed["r0"] == computed["r1"] == PROMPT - OFFERED + decode  # nothing recomputed
    assert tiers["slow"]["load_failures"] == 1
    assert tiers["slow"]["tokens_loaded"] == gap  # r1's only
    assert counters["reloads.backup"] == 1 and counters["reloaded_tokens.backup"] == gap
    assert tiers["backup"]["tokens_loaded"] == gap  # only the failed segment's tokens
    assert "hits.backup" not in counters  # the walk never reached it
    print(f"\nreload: backup re-read r0's {gap} tokens ({tiers['backup']['bytes_loaded']} B)")
