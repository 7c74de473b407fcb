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

``KNOWN_BUGS`` lists composite bugs this machine found that are not fixed yet; the generator
steers around each (see ``Gen``), and each has a strict-xfail repro in
``test_regressions.py``. Remove the entry when the bug is fixed.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcompose.testing.scripted import Behaviour, Script, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config

BLOCK = 16
MAX_MODEL_LEN = 128
MAX_PROMPT = 96
MAX_OUTPUT = 24
#: Steps the final drain may take, plus this many per unfinished request, before the
#: machine calls it a liveness failure (a request needs at most ~30 steps on its own).
DRAIN_BASE, DRAIN_PER_REQUEST = 100, 60
#: Steps with nothing scheduled, received or sent after which the drain looks for requests
#: stuck by vLLM's stale ``_inflight_prefills`` (see ``abort_stale_inflight_prefills``).
IDLE_STEPS = 20
#: A lookup that stays ``None`` "forever" (only drawn when the node deadline is 0 s).
FOREVER = 10**9

#: Composite bugs found by this machine and not fixed yet (see the module docstring), each
#: with a strict-xfail repro in test_regressions.py. ``KVCOMPOSE_RELIABILITY_STEER=0`` turns
#: the steering off (to check a fix with the machine before removing the entry).
KNOWN_BUGS: frozenset[str] = frozenset()

#: Figures over every example run in this process (written out by conftest.py).
STATS: Counter[str] = Counter()


# ----------------------------------------------------------------------------- trees
@dataclass(frozen=True)
class Shape:
    """A tree shape: its leaves and how to build it for a given lookup deadline."""

    name: str
    leaves: tuple[str, ...]
    build: Callable[[float], dict[str, Any]]
    #: ``kv_transfer_params`` a request may carry (route rules read them).
    params: tuple[dict[str, Any] | None, ...] = (None,)
    #: Draw hits mostly on block boundaries, so that later children can stitch after them.
    aligned: bool = False


def script_name(leaf_name: str) -> str:
    return f"rel.{leaf_name}"


def _leaf(name: str, **fields: Any) -> dict[str, Any]:
    return leaf(name, script_name(name), **fields)


def _chain(policy: str) -> Callable[[float], dict[str, Any]]:
    return lambda t: chain("root", _leaf("a"), _leaf("b"), policy=policy, lookup_timeout_s=t)


def _stitch(t: float) -> dict[str, Any]:
    """root = chain[stitch](a, b, c native; d sole owner): scripted children hold the
    prompt's first tokens, so each native one can load the range after the earlier ones."""
    native = {"load_range": "native"}
    return chain(
        "root",
        _leaf("a", **native),
        _leaf("b", **native),
        _leaf("c", **native),
        _leaf("d"),
        policy="stitch",
        lookup_timeout_s=t,
    )


def _stitch_nested(t: float) -> dict[str, Any]:
    """root = chain[stitch](fast native, chain[first](slow1, slow2) as one owner, disk native)"""
    slow = chain("slow", _leaf("slow1"), _leaf("slow2"), lookup_timeout_s=t)
    native = {"load_range": "native"}
    return chain(
        "root", _leaf("fast", **native), slow, _leaf("disk", **native), policy="stitch",
        lookup_timeout_s=t,
    )  # fmt: skip


def _route(t: float) -> dict[str, Any]:
    return {
        "kind": "route",
        "name": "root",
        "default": "b",
        "lookup_timeout_s": t,
        "rules": [{"child": "a", "param": "tier", "equals": "a"}],
        "children": [_leaf("a"), _leaf("b")],
    }


def _fanout(t: float) -> dict[str, Any]:
    return {
        "kind": "fanout",
        "name": "root",
        "load_from": "b",
        "lookup_timeout_s": t,
        "children": [_leaf("a"), _leaf("b")],
    }


def _nested(t: float) -> dict[str, Any]:
    """root = chain[longest](route pick(fast | default → chain[first](slow1, slow2)), disk)"""
    slow = chain("slow", _leaf("slow1"), _leaf("slow2"), lookup_timeout_s=t)
    pick = {
        "kind": "route",
        "name": "pick",
        "default": "slow",
        "lookup_timeout_s": t,
        "rules": [{"child": "fast", "param": "fast"}],
        "children": [_leaf("fast"), slow],
    }
    return chain("root", pick, _leaf("disk"), policy="longest", lookup_timeout_s=t)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("chain-first", ("a", "b"), _chain("first")),
        Shape("chain-longest", ("a", "b"), _chain("longest")),
        Shape("route", ("a", "b"), _route, ({"tier": "a"}, {"tier": "b"}, None, {"tier": None})),
        Shape("fanout", ("a", "b"), _fanout),
        Shape("nested", ("fast", "slow1", "slow2", "disk"), _nested, (None, {"fast": True})),
        Shape("chain-stitch", ("a", "b", "c", "d"), _stitch, aligned=True),
        Shape("stitch-nested", ("fast", "slow1", "slow2", "disk"), _stitch_nested, aligned=True),
    )
}


# ------------------------------------------------------------------------ behaviours
_DEFAULT = Behaviour()


class B(Behaviour):
    """A ``Behaviour`` that prints only what differs from the default (falsifying examples
    stay readable); ``delay_free_if_loading`` is shown as ``delay_while_loading``."""

    def __repr__(self) -> str:
        parts = []
        for name in Behaviour.__dataclass_fields__:
            value = getattr(self, name)
            if name == "delay_free_if_loading":
                if self.delay_free and value:
                    parts.append("delay_while_loading")
                continue
            if value != getattr(_DEFAULT, name):
                if value is True:
                    parts.append(name)
                elif name == "raise_in":
                    parts.append(f"raise_in={sorted(value)}")
                else:
                    parts.append(f"{name}={value!r}")
        return f"B({', '.join(parts)})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis' printer
        p.text(repr(self))


@dataclass(frozen=True)
class Gen:
    """What the behaviour generator may draw in one example."""

    breakers: bool  # contract breakers allowed (violations expected, no crash)
    deadline_zero: bool  # node lookup deadline ~0 s (1 ns): a second None is a miss
    policy: str  # kv_load_failure_policy
    aligned: bool = False  # hits mostly on block boundaries (stitch shapes)


@st.composite
def behaviours(draw: st.DrawFn, leaf_name: str, gen: Gen, rank: int = 0) -> Behaviour:
    kind = draw(st.sampled_from(("miss", "sync", "async")), label=f"{leaf_name}.kind")
    tokens = 0
    if kind != "miss" and gen.aligned:
        unaligned = draw(st.integers(0, 7), label=f"{leaf_name}.unaligned") == 0
        # later children tend to hold more, so that three segments stitch too
        ladder = min((rank + 1 + draw(st.integers(0, 3))) * BLOCK, MAX_PROMPT - BLOCK)
        tokens = draw(st.integers(1, MAX_PROMPT)) if unaligned else ladder
    elif kind != "miss":
        tokens = draw(
            st.one_of(
                st.integers(1, MAX_PROMPT),
                st.sampled_from((BLOCK, 2 * BLOCK, 3 * BLOCK, 5 * BLOCK)),
            )
        )
    pending = draw(
        st.one_of(
            st.just(0), st.integers(1, 3), st.just(FOREVER) if gen.deadline_zero else st.nothing()
        )
    )
    load = "ok"
    invalid_block = 0
    load_steps = 1
    if kind != "miss":
        load = draw(st.sampled_from(("ok", "ok", "fail", "invalid")))
        if load != "ok":
            invalid_block = draw(st.integers(0, 3))
    if kind == "async":
        load_steps = draw(st.integers(1, 4))
    delay = draw(st.integers(0, 3)) == 0
    send_steps = draw(st.integers(1, 4)) if delay else 1
    params = draw(st.sampled_from((None, {f"p.{leaf_name}": 1})))
    raise_in: set[str] = set()
    if draw(st.integers(0, 15)) == 0:
        raise_in.add("get_num_new_matched_tokens")
    if (tokens == 0 or raise_in) and draw(st.integers(0, 15)) == 0:
        # only where the child cannot own the load: an owner's alloc error must propagate
        raise_in.add("update_state_after_alloc")
    if draw(st.integers(0, 15)) == 0:
        raise_in.add("request_finished")
    b = B(
        tokens=tokens,
        is_async=kind == "async",
        pending_lookups=pending,
        load=load,
        invalid_block=invalid_block,
        load_steps=load_steps,
        delay_free=delay,
        send_steps=send_steps,
        params=params,
        raise_in=frozenset(raise_in),
        delay_free_if_loading=False,
    )
    if gen.breakers:
        b.delay_free_if_loading = delay and draw(st.booleans())
        b.break_zero_async = draw(st.integers(0, 5)) == 0
        b.break_rogue_recv = draw(st.integers(0, 5)) == 0
        b.break_duplicate_recv = kind == "async" and draw(st.integers(0, 3)) == 0
        b.break_rogue_send = draw(st.integers(0, 5)) == 0
    return b


def is_breaker(b: Behaviour) -> bool:
    return (
        b.break_zero_async
        or b.break_rogue_recv
        or b.break_duplicate_recv
        or b.break_rogue_send
        or (b.delay_free and b.delay_free_if_loading)
    )


# --------------------------------------------------------------------------- helpers
def composites(connector: Any) -> Iterator[Any]:
    """The composite node and its composite descendants, parents first."""
    from kvcompose.composite import CompositeConnector

    if isinstance(connector, CompositeConnector):
        yield connector
        for child in connector.children:
            yield from composites(child.connector)


def leaves(connector: Any) -> Iterator[Any]:
    from kvcompose.composite import CompositeConnector

    if isinstance(connector, CompositeConnector):
        for child in connector.children:
            yield from leaves(child.connector)
    else:
        yield connector


class InvariantError(AssertionError):
    """An invariant of the composite on vLLM's scheduler does not hold."""


def check(cond: bool, message: str) -> None:
    if not cond:
        raise InvariantError(message)


# ----------------------------------------------------------------------- the machine
class KVComposeMachine(RuleBasedStateMachine):
    """Invariants, checked after every engine step and every rule:

    1. vLLM's scheduler never asserts or raises (any exception fails the example);
    2. every child hears ``request_finished`` exactly once per request, once it is finished,
       and never before; a request that finishes in a step returns every child's
       ``kv_transfer_params``, merged;
    3. a ``finished_recving`` reaches the scheduler only for a request with an async load in
       flight, at most once per load, in the step its owner (the leaf that was allocated the
       external tokens) reported it; ``failed_recving`` only with it and (contract-obeying
       children) only when the owner reported the failure; an owner's report is never lost;
    4. a ``finished_sending`` reaches the scheduler at most once per request, only for a
       request some leaf delayed, and only after every delaying leaf reported its send; until
       then the request keeps its blocks (stays in the scheduler);
    5. no composite node's ledger holds a finished request; the root worker's loads in flight
       are exactly the async loads not yet received (contract-obeying children);
    6. contract-obeying children cause zero guard violations, on any node, either side;
       guard errors only name methods a behaviour was scripted to raise in;

    and at the end, after a drain of a bounded number of steps (liveness):

    7. the scheduler is empty, every block is back in the pool, every composite's
       ``live_requests()`` and every leaf's ``live_requests()`` are empty, every async load
       was received once, every request some leaf delayed got its ``finished_sending`` once
       (contract-obeying children);

    and for stitched loads (several leaves allocated tokens of one request in one step):

    8. each token is loaded by exactly one child (the leaves' ranges, from their lookup
       argument and count, do not overlap); the one ``finished_recving`` goes up only once
       every leaf with an async segment reported, never in ``failed_recving`` (one KV cache
       group: a failed segment goes up as invalid blocks); an abort waits for every segment
       (3 and 4 above hold per stitched load).
    """

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

    # ------------------------------------------------------------------ set-up
    @initialize(data=st.data())
    def build(self, data: st.DataObject) -> None:
        from kvcompose.engine.harness import SchedulerHarness

        policy = data.draw(st.sampled_from(("recompute", "fail")), label="failure_policy")
        deadline_zero = data.draw(st.booleans(), label="deadline_zero")
        breakers = data.draw(st.integers(0, 3), label="breakers") == 3
        num_blocks = data.draw(st.sampled_from((160, 10, 16, 24, 48)), label="num_blocks")
        max_num_seqs = data.draw(st.integers(2, 8), label="max_num_seqs")
        budget = data.draw(st.sampled_from((256, 64, 128)), label="max_num_batched_tokens")
        self.gen = Gen(
            breakers=breakers,
            deadline_zero=deadline_zero,
            policy=policy,
            aligned=self.shape.aligned,
        )
        self.scripts = {name: script(script_name(name)) for name in self.shape.leaves}
        self.cursor = dict.fromkeys(self.shape.leaves, 0)
        tree = self.shape.build(1e-9 if deadline_zero else 3600.0)
        self.h = SchedulerHarness(
            self.model_dir,
            kvcompose_config(tree),
            block_size=BLOCK,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            kv_load_failure_policy=policy,
            with_worker=True,
        )
        STATS["examples"] += 1
        STATS[f"examples.{policy}"] += 1
        STATS["examples.breakers" if breakers else "examples.clean"] += 1

    # ------------------------------------------------------------------- rules
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        assert self.gen is not None
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
        drawn = self.avoid_known_bugs(drawn)
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
        self.h.add_request(prompt, max_tokens=max_tokens, kv_transfer_params=params, request_id=rid)
        STATS["requests"] += 1

    def avoid_known_bugs(self, drawn: dict[str, Behaviour]) -> dict[str, Behaviour]:
        assert self.gen is not None
        if not steering():
            return drawn
        if "invalid-blocks-do-not-exclude-the-owner" in KNOWN_BUGS and (
            self.gen.policy == "recompute"
        ):
            for b in drawn.values():
                if b.is_async and b.load == "invalid":
                    b.failed_loads = 1  # a transient failure: the re-lookup's load succeeds
        if (
            "finish-while-loading-with-delay" in KNOWN_BUGS
            and self.gen.policy == "fail"
            and any(b.is_async and b.load != "ok" for b in drawn.values())
        ):
            for b in drawn.values():
                b.delay_free = False
        return drawn

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.do_step()

    @precondition(lambda self: self.h is not None and self.h.has_work())
    @rule()
    def run(self) -> None:
        """Step until a request finishes or a receive or send arrives (at most 16 steps)."""
        for _ in range(16):
            result = self.do_step()
            out = result.kv_connector_output
            if result.finished or (
                out is not None and (out.finished_recving or out.finished_sending)
            ):
                return

    @precondition(lambda self: self.h is not None and bool(self.h.scheduler.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        by_phase: dict[str, list[str]] = defaultdict(list)
        for rid in sorted(self.h.scheduler.requests):
            by_phase[self.phase(rid)].append(rid)
        for offered in by_phase:
            STATS[f"abort_offered.{offered}"] += 1
        phase = data.draw(st.sampled_from(sorted(by_phase)), label="abort_phase")
        rid = data.draw(st.sampled_from(by_phase[phase]), label="abort")
        if not self.abort_allowed(rid, phase):
            STATS[f"abort_steered.{phase}"] += 1
            return
        STATS[f"abort.{phase}"] += 1
        self.h.abort(rid)
        self.scan()
        self.check_requests()

    def abort_allowed(self, rid: str, phase: str) -> bool:
        if steering() and "finish-while-loading-with-delay" in KNOWN_BUGS and phase == "loading":
            return not any(b.delay_free for b in self.behaviour[rid].values())
        return True

    @precondition(lambda self: self.h is not None and bool(self.h.scheduler.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
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

    def scan(self) -> dict[str, set[tuple[str, bool]]]:
        """Read the leaves' new call records; returns this step's recv reports by request."""
        recv: dict[str, set[tuple[str, bool]]] = defaultdict(set)
        ranges: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # this batch's loads
        new_async: dict[str, set[str]] = defaultdict(set)
        for name, s in self.scripts.items():
            calls = s.calls[self.cursor[name] :]
            self.cursor[name] = len(s.calls)
            for call in calls:
                kind = call[0]
                if kind == "alloc" and call[2] > 0:
                    rid = call[1]
                    b = s.behaviour(rid)
                    STATS["loads.async" if b.is_async else "loads.sync"] += 1
                    start = self.last_lookup.get((name, rid), 0)
                    ranges[rid].append((start, start + call[2], name))
                    if b.is_async:
                        check(
                            rid not in self.loads,
                            f"{rid}: a second async load ({name}) while one from "
                            f"{self.loads.get(rid)} is in flight",
                        )
                        new_async[rid].add(name)
                    if b.load != "ok":
                        STATS[f"loads.{b.load}.{'async' if b.is_async else 'sync'}"] += 1
                elif kind == "delay":
                    self.delayers[call[1]].add(name)
                    STATS["delays"] += 1
                elif kind == "recv_report":
                    recv[call[1]].add((name, call[2]))
                elif kind == "send_report":
                    self.sent[call[1]].add(name)
                elif kind == "lookup":
                    STATS["lookups"] += 1
                    self.last_lookup[(name, call[1])] = call[2]
        for rid, loaded in ranges.items():
            # (8) each token is loaded by exactly one child
            loaded.sort()
            for (_, end, first), (start, _, second) in itertools.pairwise(loaded):
                check(
                    end <= start,
                    f"{rid}: {first} and {second} both load tokens [{start}, {end})",
                )
            if len(loaded) > 1:
                self.stitched.add(rid)
                STATS["loads.stitched"] += 1
                STATS[f"loads.stitched.{len(loaded)}_segments"] += 1
        for rid in ranges:
            if len(ranges[rid]) == 1:
                self.stitched.discard(rid)
        for rid, names in new_async.items():
            self.loads[rid] = names
            self.reported.pop(rid, None)
            self.async_loads[rid] += 1
        return recv

    def do_step(self) -> Any:
        result = self.h.step()
        self.steps += 1
        STATS["steps"] += 1
        self.check_step(result)
        return result

    # --------------------------------------------------------------- invariants
    def check_step(self, result: Any) -> None:
        reports = self.scan()
        out = result.kv_connector_output
        recving = set(out.finished_recving or ()) if out is not None else set()
        failed = set(out.failed_recving or ()) if out is not None else set()
        sending = set(out.finished_sending or ()) if out is not None else set()
        clean = self.gen is not None and not self.gen.breakers
        check(failed <= recving, f"failed_recving {failed - recving} without finished_recving")
        # (3a) a request that finished while its async load was in flight, with a child
        # delaying the free, gets one terminal signal: the owner's receive is merged into the
        # finished_sending (vLLM would free on the first of two and assert on the second)
        for rid, reps in reports.items():
            owners = self.loads.get(rid)
            if owners:
                self.reported[rid] |= {name for name, _ in reps} & owners
            if (
                owners
                and rid not in recving
                and owners <= self.reported[rid]
                and self.h.requests[rid].is_finished()
                and self.delayers.get(rid)
            ):
                del self.loads[rid]
                self.root_recv[rid] += 1
                STATS["root.recv_merged_into_send"] += 1
        # (3) receives: only for a load in flight, once, from its owner, never lost
        for rid in sorted(recving):
            owners = self.loads.get(rid)
            check(
                bool(owners),
                f"{rid}: finished_recving reached the scheduler with no async load in flight",
            )
            assert owners is not None
            reporters = {name for name, _ in reports.get(rid, ())}
            check(
                bool(owners & reporters) and owners <= self.reported[rid] | reporters,
                f"{rid}: finished_recving went up but its loaders {sorted(owners)} did not "
                f"all report it (this step: {sorted(reporters)}, before: "
                f"{sorted(self.reported[rid])})",
            )
            if clean and rid not in self.breaking and rid not in self.stitched:
                (owner,) = owners
                owner_failed = any(f for name, f in reports[rid] if name == owner)
                check(
                    (rid in failed) == owner_failed,
                    f"{rid}: failed_recving={rid in failed} but owner {owner!r} "
                    f"reported failed={owner_failed}",
                )
            if rid in self.stitched:
                # a stitched load (one KV cache group): a failed segment goes up as invalid
                # blocks with the one receive, never as failed_recving
                check(rid not in failed, f"{rid}: a stitched load went up in failed_recving")
                STATS["root.stitched_recv"] += 1
            del self.loads[rid]
            self.reported.pop(rid, None)
            self.root_recv[rid] += 1
            if rid in failed:
                STATS["root.failed_recving"] += 1
        if clean:
            for rid in reports:
                owners = self.loads.get(rid)
                if owners and owners <= self.reported[rid]:
                    raise InvariantError(
                        f"{rid}: loaders {sorted(owners)} reported their receives "
                        "but none reached the scheduler"
                    )
        # (4) sends: once, only after every delaying leaf reported
        for rid in sorted(sending):
            check(self.root_sent[rid] == 0, f"{rid}: a second finished_sending")
            delayers = self.delayers.get(rid, set())
            check(bool(delayers), f"{rid}: finished_sending but no child delayed the free")
            missing = delayers - self.sent[rid]
            check(not missing, f"{rid}: finished_sending before {sorted(missing)} reported")
            self.root_sent[rid] += 1
        # (2b) the client gets every child's kv_transfer_params, merged
        for rid, info in result.finished.items():
            if "error" in str(info.finish_reason).lower():
                continue  # vLLM reports load-failure errors without params
            expected: dict[str, Any] = {}
            for b in self.behaviour[rid].values():
                if b.params and "request_finished" not in b.raise_in:
                    expected.update(b.params)
            check(
                (info.kv_transfer_params or {}) == expected,
                f"{rid}: kv_transfer_params {info.kv_transfer_params} != merged {expected}",
            )
        self.check_requests()
        self.check_tables()

    def check_requests(self) -> None:
        """(2) request_finished exactly once; (4) blocks held while a delayer is pending."""
        sched = self.h.scheduler
        for rid, req in self.h.requests.items():
            done = req.is_finished()
            for name, s in self.scripts.items():
                n = s.finished[rid]
                check(
                    n == (1 if done else 0),
                    f"{rid} ({req.status.name}): {name} heard request_finished {n} times",
                )
            pending = self.delayers.get(rid, set()) - self.sent[rid]
            if pending:
                check(
                    rid in sched.requests,
                    f"{rid}: blocks freed while {sorted(pending)} still sending",
                )
            if rid in self.loads:
                check(
                    rid in sched.requests,
                    f"{rid}: blocks freed while {sorted(self.loads[rid])} still load into them",
                )

    def check_tables(self) -> None:
        """(5) ledgers hold no finished request; (6) violations / errors."""
        clean = self.gen is not None and not self.gen.breakers
        live = {rid for rid, req in self.h.requests.items() if not req.is_finished()}
        for node in composites(self.h.connector):
            stray = set(node.ledger.snapshot()) - live
            check(not stray, f"node {node.name}: ledger holds finished requests {sorted(stray)}")
        if clean:
            live = self.h.worker_connector.signals.live()
            in_flight = set(live.get("loads_in_flight", {})) | set(
                live.get("stitches_in_flight", {})
            )
            check(
                in_flight == set(self.loads),
                f"worker loads in flight {sorted(in_flight)} != async loads not yet "
                f"received {sorted(self.loads)}",
            )
        for side in (self.h.connector, self.h.worker_connector):
            for node in composites(side):
                if clean:
                    check(
                        not node.guard.violations,
                        f"node {node.name} ({node.role.name}): violations from "
                        f"contract-obeying children: {dict(node.guard.violations)}",
                    )
                for _, where in node.guard.errors:
                    method = where.split(":")[0]
                    check(
                        method
                        in (
                            "get_num_new_matched_tokens",
                            "update_state_after_alloc",
                            "request_finished",
                        ),
                        f"node {node.name}: unexpected child error {where}",
                    )

    @invariant()
    def requests_and_tables(self) -> None:
        if self.h is not None:
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
            if not failing:
                self.drain_and_check()
        finally:
            self.record_stats()
            self.h.close()

    def abort_stale_inflight_prefills(self) -> bool:
        """vLLM's own liveness bug (0.32 and 0.33; see test_regressions.py): a request whose
        async load failed totally under ``recompute`` stays in the scheduler's
        ``_inflight_prefills``, so its next async load reserves its own blocks twice and is
        never admitted when the pool holds less than twice the request. Such requests are
        aborted (and counted) so the machine keeps checking kvcompose; returns whether any
        was."""
        sched = self.h.scheduler
        stale = [
            r
            for r in sched._inflight_prefills
            if r.status.name in ("WAITING", "PREEMPTED") and r.num_computed_tokens == 0
        ]
        if stale:
            STATS["vllm_bug.stale_inflight_prefill_aborted"] += len(stale)
            self.h.abort(*(r.request_id for r in stale))
        return bool(stale)

    def drain_budget(self) -> int:
        unfinished = sum(1 for r in self.h.requests.values() if not r.is_finished())
        return DRAIN_BASE + DRAIN_PER_REQUEST * unfinished

    def drain_and_check(self) -> None:
        drained = idle = 0
        limit = self.drain_budget()
        while self.h.has_work():
            check(
                drained < limit,
                f"liveness: still busy after {limit} steps with no new work: "
                f"{self.h.describe()}; ledger {self.h.connector.ownership()}",
            )
            result = self.do_step()
            drained += 1
            out = result.kv_connector_output
            moved = result.scheduler_output.total_num_scheduled_tokens > 0 or (
                out is not None and (out.finished_recving or out.finished_sending)
            )
            idle = 0 if moved else idle + 1
            # Nothing scheduled, nothing received or sent for IDLE_STEPS steps (pending
            # lookups, loads and sends take at most 4): if vLLM's stale in-flight prefill
            # holds the queue (FCFS: it blocks every request behind it), abort it and give
            # the rest a fresh budget.
            if idle >= IDLE_STEPS and self.abort_stale_inflight_prefills():
                idle = 0
                limit = drained + self.drain_budget()
        STATS["drain_steps"] += drained
        STATS["max_drain_steps"] = max(STATS["max_drain_steps"], drained)
        if self.gen is not None and self.gen.breakers:
            # Rogue signals hold no blocks: the scheduler may go idle before a breaker's
            # timer fires. Keep stepping (as other traffic would) until they did: the late
            # signals, for requests long gone, must be dropped without a crash.
            for _ in range(8):
                if not any(c.live_requests() for c in leaves(self.h.worker_connector)):
                    break
                self.do_step()
                STATS["flush_steps"] += 1
        # (7) nothing left
        self.h.assert_clean()
        for conn in leaves(self.h.connector):
            check(
                not conn.live_requests(), f"scheduler-side leaf state left: {conn.live_requests()}"
            )
        for conn in leaves(self.h.worker_connector):
            check(not conn.live_requests(), f"worker-side leaf state left: {conn.live_requests()}")
        check(not self.loads, f"async loads never received: {self.loads}")
        self.check_requests()
        for rid in self.h.requests:
            check(
                self.root_recv[rid] == self.async_loads[rid],
                f"{rid}: {self.async_loads[rid]} async loads, {self.root_recv[rid]} receives",
            )
            if rid in self.breaking or (self.gen is not None and self.gen.breakers):
                continue
            expected = 1 if self.delayers.get(rid) else 0
            check(
                self.root_sent[rid] == expected,
                f"{rid}: delayed by {sorted(self.delayers.get(rid, ()))}, "
                f"{self.root_sent[rid]} finished_sending",
            )
        note(f"{self.steps} steps, {len(self.h.requests)} requests")

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


def steering() -> bool:
    """Whether the generator steers around ``KNOWN_BUGS`` (``KVCOMPOSE_RELIABILITY_STEER``)."""
    return os.environ.get("KVCOMPOSE_RELIABILITY_STEER", "1") != "0"
