"""A hypothesis state machine that drives vLLM's real scheduler with a kvcompose tree.

Every example builds a ``SchedulerHarness`` (vLLM's real v1 ``Scheduler`` plus a worker-side
connector driven per step) over one tree of ``ScriptedConnector`` children, then interleaves:

- ``add_request``: a request whose behaviour is drawn per child (miss, sync hit, async hit,
  ``None`` for k lookups, load ok / ``failed_recving`` / invalid blocks total or partial,
  delayed free, ``kv_transfer_params``, exceptions in lookup / alloc / finish, and — in
  *breakers* examples — the ``break_*`` contract breakers);
- ``step``: one to four engine steps;
- ``abort``: any request still in the scheduler, at whatever phase it is in (queued, lookup
  pending, waiting for remote KV, running, preempted, finished but held for a send);
- ``preempt``: a running request, through the scheduler's own preemption path (memory
  pressure preempts too: the block pool is drawn small as often as large).

Each example also draws ``kv_load_failure_policy``, the node lookup deadline (0 s or an hour,
both deterministic), the block pool, ``max_num_seqs`` and the token budget.

Invariants are checked after every rule (``check_step`` after each engine step), and at the
end, after every request has run to completion (``teardown``): see ``KVComposeMachine``.

``KNOWN_BUGS`` lists composite bugs this machine found that are not fixed yet (none now); each
gets a strict-xfail repro in ``test_regressions.py`` and a steer where the behaviours are
drawn (``add_request``) or aborts chosen, that keeps the machine off it until it is fixed.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from machine_behaviours import Gen, behaviours, is_breaker
from machine_checks import Checks, composites
from machine_shapes import (
    BLOCK,
    MAX_MODEL_LEN,
    MAX_OUTPUT,
    MAX_PROMPT,
    SHAPES,
    SLIDING_WINDOW,
    Shape,
    script_name,
    with_on_error_fail,
)
from machine_stats import STATS

from kvcompose.testing.scripted import Behaviour, Script, script
from kvcompose.testing.trees import kvcompose_config

__all__ = ["BLOCK", "KNOWN_BUGS", "SHAPES", "STATS", "KVComposeMachine", "machine_for"]


#: Composite bugs found by this machine and not fixed yet (see the module docstring), each
#: with a strict-xfail repro in test_regressions.py.
KNOWN_BUGS: frozenset[str] = frozenset()
#: The former "async-scheduling-sync-load-failure-stuck" is vLLM's own (a plain connector
#: shows it: test_vllm_async_scheduling_leaks_a_placeholder_after_sync_invalid_blocks);
#: the drain aborts the requests it strands (``Checks.abort_leaked_placeholders``) instead of
#: the generator steering around failing sync loads under async scheduling.


def frozen_clock() -> float:
    return 0.0


class KVComposeMachine(Checks, RuleBasedStateMachine):
    """Rules that drive vLLM's scheduler; the invariants are ``Checks``' (see its docstring)."""

    shape: ClassVar[Shape]
    model_dir: ClassVar[Path]

    def __init__(self) -> None:
        super().__init__()
        self.h: Any = None
        self.gen: Gen | None = None
        self.scripts: dict[str, Script] = {}
        self.cursor: dict[str, int] = {}
        self.behaviour: dict[str, dict[str, Behaviour]] = {}  # req -> leaf -> behaviour
        self.breaking: set[str] = set()  # requests with a contract-breaking child
        # req -> leaves loading the async load in flight (several: a stitched load), and
        # which of them reported their receive so far
        self.loads: dict[str, set[str]] = {}
        self.reported: dict[str, set[str]] = defaultdict(set)
        self.last_lookup: dict[tuple[str, str], int] = {}  # (leaf, req) -> lookup argument
        self.stitched: set[str] = set()  # requests whose last load had several segments
        self.delayers: dict[str, set[str]] = defaultdict(set)
        self.sent: dict[str, set[str]] = defaultdict(set)
        self.root_recv: Counter[str] = Counter()
        self.root_sent: Counter[str] = Counter()
        self.async_loads: Counter[str] = Counter()
        self.forced_preemptions = 0
        self.steps = 0
        self.next_id = 0
        self.t0 = time.perf_counter()
        # a child's error went through to vLLM: the engine is dead, the example is over
        self.dead = False
        self.propagating = False
        self.raise_log: list[tuple[str, str, str]] = []  # (leaf, method, request) per raise
        self.worker_raisers: set[str] = set()  # leaves whose worker-side raise was contained
        # request -> bad blocks its async loader raised while naming (lost with the raise)
        self.lost_bad: dict[str, set[int]] = {}
        # (leaf, request): loads the node failed for the leaf's raise; their late reports
        # are fenced
        self.fenced: set[tuple[str, str]] = set()
        self.last_hit: dict[tuple[str, str], int] = {}  # (leaf, req) -> its last answer
        # running requests vLLM cut back for invalid blocks under async scheduling
        self.cut_back_async: set[str] = set()
        self.async_scheduling = False
        self.last_answer: dict[str, tuple[Any, ...]] = {}  # req -> the root's last answer
        # several KV cache groups: loads fail by request (see ``Checks``)
        self.by_request = False
        self.seg_failed: set[str] = set()  # requests whose load round has a failed part

    # ------------------------------------------------------------------ set-up
    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        from kvcompose.engine.harness import AsyncSchedulerHarness, SchedulerHarness

        policy = data.draw(st.sampled_from(("recompute", "fail")), label="failure_policy")
        deadline_zero = data.draw(st.booleans(), label="deadline_zero")
        breakers = data.draw(st.integers(0, 3), label="breakers") == 3
        pools = (160, 10, 16, 24, 48) if self.shape.groups == 1 else (256, 40, 64)
        num_blocks = data.draw(st.sampled_from(pools), label="num_blocks")
        max_num_seqs = data.draw(st.integers(2, 8), label="max_num_seqs")
        budget = data.draw(st.sampled_from((256, 64, 128)), label="max_num_batched_tokens")
        async_scheduling = data.draw(st.booleans(), label="async_scheduling")
        fail_leaves: frozenset[str] = frozenset()
        if data.draw(st.integers(0, 3), label="on_error_fail") == 3:
            fail_leaves = frozenset(
                data.draw(
                    st.sets(st.sampled_from(self.shape.leaves), min_size=1),
                    label="fail_leaves",
                )
            )
        self.gen = Gen(
            breakers=breakers,
            deadline_zero=deadline_zero,
            policy=policy,
            aligned=self.shape.aligned,
            fail_leaves=fail_leaves,
        )
        self.scripts = {name: script(script_name(name)) for name in self.shape.leaves}
        self.cursor = dict.fromkeys(self.shape.leaves, 0)
        tree = with_on_error_fail(self.shape.build(1e-9 if deadline_zero else 3600.0), fail_leaves)
        self.async_scheduling = async_scheduling
        harness = AsyncSchedulerHarness if async_scheduling else SchedulerHarness
        config = kvcompose_config(tree)
        hybrid: dict[str, Any] = {}
        if self.shape.groups > 1:  # the tiny model made hybrid: a sliding and a full group
            config["kv_connector"] = "KVComposeHMA"
            hybrid["sliding_window"] = SLIDING_WINDOW
        self.h = harness(
            self.model_dir,
            config,
            block_size=BLOCK,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            kv_load_failure_policy=policy,
            with_worker=True,
            layer_calls=True,
            **hybrid,
        )
        groups = len(self.h.kv_cache_config.kv_cache_groups)
        assert groups == self.shape.groups, f"{groups} KV cache groups, not {self.shape.groups}"
        self.by_request = self.h.connector.scheduler_side.by_request
        if self.h.connector.scheduler_side.costs is not None:  # ``fastest``: frozen time
            # (hypothesis replays an example exactly: its decisions must not read the clock)
            self.h.connector.scheduler_side.costs.clock = frozen_clock
            self.h.worker_connector.worker_side.timer.clock = frozen_clock
        self.watch_answers()
        STATS["examples"] += 1
        if fail_leaves:
            STATS["examples.on_error_fail"] += 1
        if async_scheduling:
            STATS["examples.async_scheduling"] += 1
        if self.by_request:
            STATS["examples.two_groups"] += 1
        STATS[f"examples.{policy}"] += 1
        STATS["examples.breakers" if breakers else "examples.clean"] += 1

    # ------------------------------------------------------------------- rules
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        assert self.gen is not None
        if self.dead:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        length = data.draw(
            st.integers(MAX_PROMPT - BLOCK, MAX_PROMPT)
            if self.shape.aligned and data.draw(st.booleans(), label="long_prompt")
            else st.one_of(st.integers(BLOCK + 1, MAX_PROMPT), st.integers(1, BLOCK)),
            label="prompt_tokens",
        )
        family = data.draw(st.sampled_from((None, None, None, 0, 1)), label="prefix_family")
        max_tokens = data.draw(st.integers(1, MAX_OUTPUT), label="max_tokens")
        params = data.draw(st.sampled_from(self.shape.params), label="kv_transfer_params")
        drawn = {
            name: data.draw(behaviours(name, self.gen, rank), label=name)
            for rank, name in enumerate(self.shape.leaves)
        }
        self.behaviour[rid] = drawn
        if any(is_breaker(b) for b in drawn.values()):
            self.breaking.add(rid)
        for name, b in drawn.items():
            self.scripts[name].per_request[rid] = b
        prompt = (
            self.h.make_prompt(length, seed=rid)
            if family is None
            else self.h.make_prompt(MAX_PROMPT, seed=f"family{family}")[:length]
        )
        self.harness_call(
            self.h.add_request,
            prompt,
            max_tokens=max_tokens,
            kv_transfer_params=params,
            request_id=rid,
        )
        STATS["requests"] += 1

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            if self.do_step() is None:
                return

    @precondition(lambda self: self.h is not None and self.h.has_work())
    @rule()
    def run(self) -> None:
        """Step until a request finishes or a receive or send arrives (at most 16 steps)."""
        for _ in range(16):
            result = self.do_step()
            if result is None:
                return
            out = result.kv_connector_output
            if result.finished or (
                out is not None and (out.finished_recving or out.finished_sending)
            ):
                return

    @precondition(lambda self: self.h is not None and bool(self.h.scheduler.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if self.dead:
            return
        by_phase: dict[str, list[str]] = defaultdict(list)
        for rid in sorted(self.h.scheduler.requests):
            by_phase[self.phase(rid)].append(rid)
        for offered in by_phase:
            STATS[f"abort_offered.{offered}"] += 1
        phase = data.draw(st.sampled_from(sorted(by_phase)), label="abort_phase")
        rid = data.draw(st.sampled_from(by_phase[phase]), label="abort")
        STATS[f"abort.{phase}"] += 1
        self.harness_call(self.h.abort, rid)
        if not self.dead:
            self.scan()
            self.check_requests()

    @precondition(lambda self: self.h is not None and bool(self.h.scheduler.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        if self.dead:
            return
        running = sorted(r.request_id for r in self.h.scheduler.running)
        rid = data.draw(st.sampled_from(running), label="preempt")
        self.h.preempt(rid)
        self.forced_preemptions += 1
        self.scan()

    # -------------------------------------------------------------- observation
    def phase(self, rid: str) -> str:
        from vllm.v1.request import RequestStatus

        req = self.h.scheduler.requests[rid]
        if req.is_finished():
            return "saving"
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return "loading"
        if req.status == RequestStatus.RUNNING:
            return "running"
        record = self.h.connector.ledger.get(rid)
        if record is not None and record.state.value == "pending":
            return "pending_lookup"
        if req.status == RequestStatus.PREEMPTED:
            return "preempted"
        return "queued"

    def do_step(self) -> Any:
        """One engine step, checked; None when a child's error reached vLLM (the engine is
        dead: the example ends there)."""
        if self.dead:
            return None
        result = self.harness_call(self.h.step)
        if result is None:
            return None
        self.steps += 1
        STATS["steps"] += 1
        self.check_step(result)
        return result

    # --------------------------------------------------------------- invariants
    @invariant()
    def requests_and_tables(self) -> None:
        if self.h is not None and not self.dead:
            self.check_requests()
            self.check_tables()

    # ------------------------------------------------------------------ the end
    def teardown(self) -> None:
        if self.h is None:
            return
        exc = sys.exc_info()[0]
        failing = exc is not None  # a failure, or hypothesis cut the example short
        if failing:
            overrun = exc.__name__ in ("StopTest", "Frozen")
            STATS["examples.overrun" if overrun else "examples.failing"] += 1
        try:
            if not failing and not self.dead:
                self.drain_and_check()
        finally:
            self.record_stats()
            self.h.close()

    def record_stats(self) -> None:
        STATS["requests.preempted.forced"] += self.forced_preemptions
        natural = sum(r.num_preemptions for r in self.h.requests.values())
        STATS["requests.preempted.natural"] += max(0, natural - self.forced_preemptions)
        for side in (self.h.connector, self.h.worker_connector):
            for node in composites(side):
                for (_child, kind), n in node.guard.violations.items():
                    STATS[f"violations.{kind}"] += n
                for (_child, where), n in node.guard.errors.items():
                    STATS[f"errors.{where.split(':')[0]}"] += n
        for req in self.h.requests.values():
            reason = str(req.get_finished_reason() or "unfinished").lower()
            STATS[f"finished.{reason.split('.')[-1]}"] += 1
        STATS["seconds"] += time.perf_counter() - self.t0


def machine_for(shape_name: str, model_dir: Path) -> type[KVComposeMachine]:
    """The machine class for one tree shape (hypothesis builds a fresh instance per example)."""
    return type(
        f"KVComposeMachine_{shape_name.replace('-', '_')}",
        (KVComposeMachine,),
        {"shape": SHAPES[shape_name], "model_dir": model_dir},
    )
