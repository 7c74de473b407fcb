"""Minimal reproductions of what the randomized state machine found.

Each test is the shrunk failing sequence, rewritten by hand on the same harness. Composite
bugs that are not fixed yet are ``xfail(strict=True)``: when the fix lands the test passes,
strict xfail turns that into a failure, and whoever fixed it removes the mark and the matching
entry of ``kv_machine.KNOWN_BUGS`` (which keeps the random suite away from the bug meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_machine import BLOCK

from kvcompose.engine.harness import HarnessStuck, SchedulerHarness
from kvcompose.testing.scripted import Behaviour, direct, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt


@pytest.fixture
def make(tiny_model: Path) -> Iterator[Callable[..., SchedulerHarness]]:
    made: list[SchedulerHarness] = []

    def build(tree: dict[str, Any], *, hma: bool = False, **kw: Any) -> SchedulerHarness:
        """``hma``: the root is ``KVComposeHMA`` (for ``sliding_window``: 2 groups)."""
        kw.setdefault("block_size", BLOCK)
        kw.setdefault("with_worker", True)
        kw.setdefault("max_model_len", 256)
        kw.setdefault("num_blocks", 64)
        config = kvcompose_config(tree)
        if hma:
            config["kv_connector"] = "KVComposeHMA"
        h = SchedulerHarness(tiny_model, config, **kw)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def run_holding(
    h: SchedulerHarness, rid: str, sender: Any, loader: Any = None, max_steps: int = 40
) -> None:
    """Step until idle, checking that ``rid`` keeps its blocks until ``sender`` (the Script
    of a child that delayed the free) reported its send and ``loader`` (the Script of the
    child loading into them, if any) reported its receive."""
    for _ in range(max_steps):
        if not h.has_work():
            return
        h.step()
        if rid not in h.scheduler.requests:
            assert sender.send_reports(rid) >= 1, "blocks freed while a child was still sending"
            assert loader is None or loader.recv_reports(rid), (
                "blocks freed while a child was still loading into them"
            )
    raise AssertionError(f"still busy after {max_steps} steps: {h.describe()}")


def keeper(h: SchedulerHarness) -> None:
    """A plain request that keeps the engine stepping (as other traffic would), so that a
    late signal for a request already gone reaches the scheduler."""
    h.add_request(prompt(40, seed=99), max_tokens=12)


# ------------------------------------------------- finish while loading, with a delayer
FINISH_WHILE_LOADING = (
    "composite bug: a request finished while its async load is in flight, with a child that "
    "delays the free, gets both finished_recving and finished_sending; vLLM's scheduler "
    "frees the request on the first and asserts on the second"
)


@pytest.mark.parametrize(
    ("load_steps", "send_steps"), [(2, 3), (3, 1)], ids=["recv-first", "send-first"]
)
def test_finish_while_loading_with_a_delaying_child_abort(make, load_steps, send_steps):
    """Found as: add r1 (a: async hit, b: delay_free), step until a's load is in flight,
    abort r1, step. Whichever of a's finished_recving and b's finished_sending comes first
    frees r1 (send first: while a still loads into its blocks); the second then hits
    ``assert req_id in self.requests`` in ``_update_from_kv_xfer_finished``."""
    a = script("rel.a", Behaviour(tokens=48, is_async=True, load_steps=load_steps))
    b = script("rel.b", Behaviour(delay_free=True, send_steps=send_steps))
    h = make(chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")))
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    keeper(h)
    h.step()
    assert h.connector.ownership()[rid]["state"] == "loading"
    h.abort(rid)
    run_holding(h, rid, b, a)
    h.assert_clean()


def test_finish_while_loading_with_a_delaying_child_fail_policy(make):
    """The same with ``kv_load_failure_policy="fail"``: the scheduler finishes the request
    (FINISHED_ERROR, request_finished → b delays) before it processes the finished_recving
    that came with the failure in the same output."""
    script("rel.a", Behaviour(tokens=48, is_async=True, load="fail"))
    b = script("rel.b", Behaviour(delay_free=True, send_steps=2))
    h = make(chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")), kv_load_failure_policy="fail")
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    keeper(h)
    run_holding(h, rid, b)
    assert "error" in str(h.finished[rid].finish_reason).lower()
    h.assert_clean()


def test_finish_while_loading_with_a_delaying_child_nested(make):
    """The delaying child inside a nested node that also owns the load (the nested node
    itself returns delay=True while its load is in flight)."""
    x = script("rel.x", Behaviour(tokens=48, is_async=True, load_steps=2))
    y = script("rel.y", Behaviour(delay_free=True, send_steps=3))
    script("rel.z", Behaviour())
    inner = chain("inner", leaf("x", "rel.x"), leaf("y", "rel.y"))
    h = make(chain("root", inner, leaf("z", "rel.z"), policy="longest"))
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    keeper(h)
    h.step()
    assert h.connector.ownership()[rid]["owner"] == "inner"
    h.abort(rid)
    run_holding(h, rid, y, x)
    h.assert_clean()


def test_finish_while_loading_without_a_delaying_child_is_fine(make):
    """The control: the same abort with no delaying child ends cleanly."""
    a = script("rel.a", Behaviour(tokens=48, is_async=True, load_steps=3))
    script("rel.b", Behaviour())
    h = make(chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")))
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    h.step()
    h.abort(rid)
    h.run_until_idle(max_steps=20)
    assert a.recv_reports(rid) == [False]
    h.assert_clean()


# --------------------------------------------- block-level total failure, no exclusion
def test_total_invalid_block_failure_excludes_the_owner(make):
    """Found as a liveness failure: a fan-out loading from b, b's async load reports its
    first block invalid (no local hit: nothing valid), kv_load_failure_policy=recompute.
    vLLM frees the blocks and looks the request up again (contract §2.4); the ledger is
    LOADED, not FAILED, so b is asked again. Expected: b excluded as after a
    failed_recving, the next child (a) serves the request."""
    b = script("rel.b", Behaviour(tokens=64, is_async=True, load="invalid"))
    a = script("rel.a", Behaviour(tokens=32))
    h = make(
        chain("root", leaf("b", "rel.b"), leaf("a", "rel.a")), kv_load_failure_policy="recompute"
    )
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    h.run_until_idle(max_steps=40)
    assert b.lookups(rid) == 1, "the failed child must be skipped on the re-lookup"
    assert 32 in [n for n, _ in a.allocations(rid)], "the next child serves the request"
    h.assert_clean()


def test_transient_total_invalid_block_failure_recovers(make):
    """The control: when the child's second load succeeds, the request completes."""
    b = script("rel.b", Behaviour(tokens=64, is_async=True, load="invalid", failed_loads=1))
    script("rel.a", Behaviour())
    h = make(
        chain("root", leaf("b", "rel.b"), leaf("a", "rel.a")), kv_load_failure_policy="recompute"
    )
    rid = h.add_request(prompt(80), max_tokens=2).request_id
    h.run_until_idle(max_steps=40)
    assert b.recv_reports(rid)[0] is False and len(b.recv_reports(rid)) <= 2
    h.assert_clean()


def test_partial_invalid_block_failure_recomputes_locally(make):
    """A partial block-level failure (bad block 2 of 4): the valid prefix is kept, the rest
    recomputed, no second lookup (contract §2.4)."""
    b = script("rel.b", Behaviour(tokens=64, is_async=True, load="invalid", invalid_block=2))
    h = make(chain("root", leaf("b", "rel.b")), kv_load_failure_policy="recompute")
    req = h.add_request(prompt(80), max_tokens=2)
    h.run_until_idle(max_steps=40)
    assert b.lookups(req.request_id) == 1
    assert h.finished[req.request_id].finish_reason is not None
    h.assert_clean()


# ------------------------------------------------------- worker-side and on_error: fail
def test_a_raise_while_naming_bad_blocks_fails_the_load_reported_with_them(make):
    """Found as: r1 (d: async hit of 64 tokens, load invalid, raise in
    get_block_ids_with_load_errors). The step d reports r1's receive, it raises while naming
    r1's bad block: the composite sent the receive up as a success and the bad block was lost
    with the exception, so vLLM took garbage for r1's KV. The receives a child reported in
    the step it raised in ``get_block_ids_with_load_errors`` now go up failed."""
    bad = Behaviour(
        tokens=64,
        is_async=True,
        load="invalid",
        invalid_block=1,
        raise_in=frozenset({"get_block_ids_with_load_errors"}),
    )
    a = script("rel.a", Behaviour())
    d = script("rel.d", Behaviour(), r1=bad)
    h = make(
        chain("root", leaf("a", "rel.a"), leaf("d", "rel.d")), kv_load_failure_policy="recompute"
    )
    h.add_request(prompt(80, seed=1), max_tokens=1, request_id="r1")
    failed = set()
    for _ in range(10):
        out = h.step().kv_connector_output
        if out is not None and "r1" in (out.finished_recving or ()):
            failed = set(out.failed_recving or ())
            break
    assert d.recv_reports("r1") == [False], "d reported its receive (its bad block pending)"
    assert any(c[0] == "invalid_lost" for c in d.calls), "and raised while naming the block"
    assert failed == {"r1"}, "so the load must not go up as a success"
    h.run_until_idle(max_steps=40)
    assert a.lookups("r1") == 2 and d.lookups("r1") == 1, "re-looked up without d"
    h.assert_clean()


def test_late_bad_blocks_of_a_load_failed_for_a_raise_do_not_reach_vllm(make):
    """Found as a liveness failure under async scheduling (chain-longest): a raises in
    get_transfer_results (for r2), so the composite fails a's loads in flight, r1's included
    (recompute: r1 is reset and freed). a's transfers go on: two steps later it reports r1's
    old load, with a bad block; the composite drops the receive but passes the block up."""
    a = script(
        "rel.a",
        Behaviour(),
        r1=Behaviour(tokens=48, is_async=True, load="invalid", invalid_block=1, load_steps=3),
        r2=Behaviour(tokens=48, is_async=True, raise_in=frozenset({"get_transfer_results"})),
    )
    script("rel.b", Behaviour())
    h = make(
        chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")), kv_load_failure_policy="recompute"
    )
    h.add_request(prompt(80, seed=1), max_tokens=4, request_id="r1")
    h.add_request(prompt(80, seed=2), max_tokens=4, request_id="r2")
    late: set[int] = set()
    for _ in range(40):
        if not h.has_work():
            break
        reported = len(a.recv_reports("r1"))
        out = h.step().kv_connector_output
        if len(a.recv_reports("r1")) > reported and out is not None:
            late |= set(out.invalid_block_ids or ())
    assert any(c[:2] == ("raise", "get_transfer_results") for c in a.calls)
    assert a.recv_reports("r1"), "a reported r1's old load after the composite failed it"
    assert not late, f"bad blocks {sorted(late)} of a load already failed reached vLLM"


def test_a_late_receive_of_a_failed_load_is_fenced_while_another_child_loads(make):
    """Found by the nested shape (steering off) as a fence left at the end: a raises in
    start_load_kv, so the composite fails its load of r1; the re-lookup gives r1 to b. a's
    transfer goes on and reports r1 while b's load is in flight. That receive was counted as
    a foreign_recv violation (a did nothing wrong) and a's fence was never lifted."""
    a = script(
        "rel.a",
        Behaviour(),
        r1=Behaviour(tokens=48, is_async=True, load_steps=3, raise_in=frozenset({"start_load_kv"})),
    )
    b = script("rel.b", Behaviour(), r1=Behaviour(tokens=32, is_async=True, load_steps=4))
    h = make(
        chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")),
        kv_load_failure_policy="recompute",
        layer_calls=True,
    )
    h.add_request(prompt(80, seed=1), max_tokens=3, request_id="r1")
    h.run_until_idle(max_steps=40)
    assert a.recv_reports("r1") and b.recv_reports("r1"), "a's late report came during b's load"
    assert [n for n, _ in b.allocations("r1") if n] == [32], "b owned the re-lookup's load"
    node = h.worker_connector
    assert not node.guard.violations
    assert node.counters.totals.get("fenced.a") == 1
    h.assert_clean()


def test_an_on_error_fail_leaf_under_a_miss_node_reaches_vllm_with_a_note(make):
    """Found as: nested tree, slow1 (on_error: fail) raises in request_finished under the
    node slow (on_error: miss) under root. slow re-raised half way through its finish (slow2
    never heard request_finished) and root contained that as slow's error, leaving slow's
    tables half updated. A ``fail`` child's error now goes through every node to vLLM, with
    a note naming the node, the child and the method."""
    script("rel.slow1", Behaviour(raise_in=frozenset({"request_finished"})))
    slow2 = script("rel.slow2", Behaviour())
    script("rel.disk", Behaviour())
    slow = chain("slow", leaf("slow1", "rel.slow1", on_error="fail"), leaf("slow2", "rel.slow2"))
    h = make(chain("root", slow, leaf("disk", "rel.disk")))
    h.add_request(prompt(40, seed=2), max_tokens=1, request_id="r1")
    with pytest.raises(RuntimeError, match="scripted failure in request_finished for r1") as err:
        h.run_until_idle(max_steps=10)
    notes = getattr(err.value, "__notes__", [])
    assert notes and "kvcompose[slow]: child 'slow1' raised in request_finished" in notes[0]
    assert slow2.finished["r1"] == 1, "the other children still heard the finish"


# ------------------------------------------------------------------- the test double
def test_scripted_load_blocks_start_after_the_local_hit(make):
    """Found while building the machine: ScriptedConnector placed a load at the request's
    first block, so an "invalid" load behind a local prefix hit reported a *cached, shared*
    block as bad. A load now starts after the local hit the lookup was shown."""
    base = prompt(96, seed=5)
    b = script("rel.b", Behaviour())
    h = make(chain("root", leaf("b", "rel.b")), kv_load_failure_policy="recompute")
    h.add_request(base[:40], max_tokens=1, request_id="warm")  # caches 2 full blocks
    h.run_until_idle(max_steps=20)
    b.per_request["hit"] = Behaviour(tokens=80, load="invalid")
    h.add_request(base, max_tokens=1, request_id="hit")
    h.step()
    looked_up_at = [c[2] for c in b.calls if c[0] == "lookup" and c[1] == "hit"]
    assert looked_up_at == [2 * BLOCK]
    ((_, blocks),) = b.allocations("hit")
    bad = [c[1] for c in b.calls if c[0] == "invalid_report"]
    assert bad == [(blocks[2],)], "the first loaded block, after the two cached ones"
    h.run_until_idle(max_steps=20)
    h.assert_clean()


# --------------------------------------------------- vLLM's own bug, no kvcompose involved
@pytest.mark.xfail(
    strict=True,
    raises=HarnessStuck,
    reason=(
        "vLLM bug (0.32 and 0.33): after a total async-load failure under recompute the request "
        "stays in Scheduler._inflight_prefills, so a second async load for it reserves its own "
        "blocks twice and is never admitted when the pool holds less than twice the request"
    ),
)
def test_vllm_readmits_a_request_after_its_async_load_failed(tiny_model):
    """A single connector, no kvcompose: its first async load fails, the re-lookup offers an
    async load again (a retry), and the pool (9 blocks) is smaller than twice the request
    (5 blocks). The machine found this as a liveness failure behind a kvcompose fallback."""
    s = script("rel.only", Behaviour(tokens=67, is_async=True, load="fail", failed_loads=1))
    h = SchedulerHarness(
        tiny_model,
        direct("rel.only"),
        block_size=BLOCK,
        num_blocks=10,
        max_model_len=128,
        with_worker=True,
        kv_load_failure_policy="recompute",
    )
    try:
        rid = h.add_request(prompt(69), max_tokens=1).request_id
        h.run_until_idle(max_steps=60)
        assert s.lookups(rid) == 2
        h.assert_clean()
    finally:
        h.close()


@pytest.mark.xfail(
    strict=True,
    raises=HarnessStuck,
    reason=(
        "vLLM bug (0.32 and 0.33): under async scheduling, a running request cut back by a sync "
        "load's invalid blocks keeps the output placeholder of the batch whose output vLLM "
        "skips for it; the first step it is not scheduled in, it looks one token further than "
        "it is and is never scheduled again"
    ),
)
def test_vllm_async_scheduling_leaks_a_placeholder_after_sync_invalid_blocks(tiny_model):
    """A single connector, no kvcompose: A's sync load of 8 tokens reports its block invalid.
    vLLM cuts A back to 0 and skips that batch's output for A without releasing its output
    placeholder (``Scheduler.update_from_output`` ``continue``s for ``failed_kv_load_req_ids``;
    only ``AsyncScheduler._update_request_with_output`` releases placeholders). While A is
    scheduled every step the extra placeholder is carried along; once the 8-block pool makes
    the scheduler leave A out of one batch, A has no batch in flight but one placeholder, and
    ``num_computed_tokens + 2 - num_output_placeholders >= num_prompt_tokens + max_tokens``
    keeps it from ever being scheduled for its last token. Found by the machine (``fanout``
    and ``nested`` shapes under async scheduling); this is the machine's former
    ``async-scheduling-sync-load-failure-stuck``, shrunk by a search over plain runs."""
    from kvcompose.engine.harness import AsyncSchedulerHarness

    script("rel.only", Behaviour(), A=Behaviour(tokens=8, load="invalid"))
    h = AsyncSchedulerHarness(
        tiny_model,
        direct("rel.only"),
        block_size=BLOCK,
        num_blocks=8,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=256,
        with_worker=True,
        kv_load_failure_policy="recompute",
    )
    try:
        h.add_request(prompt(56, seed=1), max_tokens=6, request_id="o0")
        h.add_request(prompt(16, seed=2), max_tokens=14, request_id="o1")
        h.step()
        h.step()
        a = h.add_request(prompt(14, seed=99), max_tokens=3, request_id="A")
        try:
            h.run_until_idle(max_steps=100)
        except HarnessStuck:
            # the leak's signature: no batch in flight holds A, yet it has a placeholder
            assert not any("A" in so.num_scheduled_tokens for so, _ in h.in_flight)
            assert a.num_output_placeholders == 1 and len(a.output_token_ids) == 2
            raise
        h.assert_clean()
    finally:
        h.close()


def test_a_fence_ends_when_its_request_is_freed(make):
    """a raises in get_transfer_results as r1's load comes due and never reports that
    receive (its transfer state went down with the exception), so the composite fails the
    load and fences it. The fence used to wait for a late receive that never came: r1 stayed
    in the worker's ``fenced_loads`` long after it finished. It now ends once vLLM frees
    r1's blocks (r1 among the step's finished requests)."""
    a = script(
        "rel.a",
        Behaviour(),
        r1=Behaviour(
            tokens=48,
            is_async=True,
            load_steps=2,
            raise_in=frozenset({"get_transfer_results"}),
            raise_loses_reports=True,
        ),
    )
    script("rel.b", Behaviour())
    h = make(
        chain("root", leaf("a", "rel.a"), leaf("b", "rel.b")), kv_load_failure_policy="recompute"
    )
    h.add_request(prompt(80, seed=3), max_tokens=3, request_id="r1")
    h.run_until_idle(max_steps=40)
    assert any(c[:2] == ("raise", "get_transfer_results") for c in a.calls)
    assert not a.recv_reports("r1"), "the raise lost a's receive"
    for _ in range(10):
        h.step()
    assert "r1" not in str(h.worker_connector.live_requests())
    h.assert_clean()


def test_late_bad_blocks_of_a_freed_request_on_two_groups_are_fenced(make):
    """Found by the machine (hma-stitch): on 2 KV cache groups, d raises in start_load_kv
    for r1's async load, so the node fails it by request (policy ``fail``: vLLM finishes
    r1 and frees its blocks, which ends d's fence). d's transfer goes on and two steps later
    names r1's bad blocks. On one group such a late report marks freed blocks invalid at
    worst; on several groups, where no block id may go up, the node took it for a fresh
    failure of d's (``fail_by_request``) and, d loading nothing, counted a contract
    violation against a child that kept the contract. It is a fenced late report."""
    d = script(
        "rel.d",
        Behaviour(),
        r1=Behaviour(
            tokens=48,
            is_async=True,
            load="invalid",
            load_steps=3,
            raise_in=frozenset({"start_load_kv"}),
        ),
    )
    tree = chain("root", leaf("d", "rel.d", connector="ScriptedHMAConnector"))
    h = make(
        tree,
        kv_load_failure_policy="fail",
        num_blocks=256,
        sliding_window=2 * BLOCK,
        hma=True,
    )
    assert h.connector.scheduler_side.by_request, "the model has 2 KV cache groups"
    h.add_request(prompt(80, seed=1), max_tokens=1, request_id="r1")
    keeper(h)
    h.run_until_idle(max_steps=40)
    assert any(c[:2] == ("raise", "start_load_kv") for c in d.calls)
    assert any(c[0] == "invalid_report" for c in d.calls), "d named r1's bad blocks late"
    violations = dict(h.worker_connector.guard.violations)
    assert not violations, f"violations from a child that kept the contract: {violations}"
    h.assert_clean()


def test_late_bad_blocks_on_two_groups_fail_no_other_load(make):
    """Found by the machine (hma-chain-first): on 2 KV cache groups, a raises in
    start_load_kv for r1's async load, so the node fails it (policy ``fail``: r1 ends and
    its blocks are freed, which ends a's fence). a's transfer goes on: it reports r1's
    receive late, with a bad block, while its load of r2 is in flight. The node drops the
    late receive, but took the bad block, which no load claims, for a failure of a's and
    failed every load of a in flight: r2 ended in an error it had nothing to do with."""
    a = script(
        "rel.a",
        Behaviour(),
        r1=Behaviour(
            tokens=48,
            is_async=True,
            load="invalid",
            load_steps=3,
            raise_in=frozenset({"start_load_kv"}),
        ),
        r2=Behaviour(tokens=48, is_async=True, load_steps=6),
    )
    tree = chain("root", leaf("a", "rel.a", connector="ScriptedHMAConnector"))
    h = make(
        tree, kv_load_failure_policy="fail", num_blocks=256, sliding_window=2 * BLOCK, hma=True
    )
    r1 = h.add_request(prompt(80, seed=1), max_tokens=2, request_id="r1")
    h.step()
    h.step()
    r2 = h.add_request(prompt(80, seed=2), max_tokens=2, request_id="r2")
    h.run_until_idle(max_steps=40)
    assert any(c[:2] == ("raise", "start_load_kv") for c in a.calls)
    assert any(c[0] == "invalid_report" and c[2] == ("r1",) for c in a.calls)
    assert "error" in str(r1.get_finished_reason()).lower()
    assert "error" not in str(r2.get_finished_reason()).lower(), "r2's good load was failed"
    assert a.recv_reports("r2") == [False]
    h.assert_clean()
