"""The randomized machine's model of what it expects, and its invariants (``Checks``).

``Checks`` is mixed into ``KVComposeMachine``: ``scan`` reads what the scripted leaves did
since the last look (their ``Script.calls``), ``check_step`` holds every engine step to the
invariants listed in ``Checks``' docstring, ``drain_and_check`` runs the final drain and the
end-of-example checks.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from hypothesis import note
from machine_behaviours import WORKER_RAISES, Gen
from machine_stats import STATS

from kvcompose.composite import CompositeConnector
from kvcompose.testing.scripted import Behaviour, Script

#: Steps the final drain may take, plus this many per unfinished request, before the
#: machine calls it a liveness failure (a request needs at most ~30 steps on its own).
DRAIN_BASE, DRAIN_PER_REQUEST = 100, 60
#: Steps with nothing scheduled, received or sent after which the drain looks for requests
#: stuck by vLLM's stale ``_inflight_prefills`` (see ``abort_stale_inflight_prefills``).
IDLE_STEPS = 20
#: Worker-side raises after which the composite fails the child's async loads in flight
#: (and those it reports in that step) in the same step's ``get_transfer_results``; a raise in
#: ``save_kv_layer`` / ``wait_for_save`` loses a save only.
FAILS_LOADS = frozenset(
    {
        "start_load_kv",
        "wait_for_layer_load",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
    }
)
SCHEDULER_RAISES = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished")


def composites(connector: Any) -> Iterator[Any]:
    """The composite node and its composite descendants, parents first."""
    if isinstance(connector, CompositeConnector):
        yield connector
        for child in connector.children:
            yield from composites(child.connector)


def leaves(connector: Any) -> Iterator[Any]:
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


class Checks:
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
       (3 and 4 above hold per stitched load);

    and against the drawn faults and shapes:

    9. an ``on_error: fail`` leaf's error reaches vLLM in the same call, with a note naming
       the leaf and the method;
    10. no garbage: blocks a leaf found bad reach vLLM as invalid in that step, also when it
        raised while reporting them (for a request not aborted meanwhile), except a parked
        stitched segment's (the node reloads or gives up that range) and a late report of a
        load the node already failed for that leaf's raise (fenced: vLLM has freed or cut
        back those blocks);
    11. no leaf is allocated more tokens than its lookup answered;
    12. ``fastest``: no node awaits the time of an async load of a request that finished, or
        whose receive vLLM saw (a load not timed by its receive failed and never will be; a
        cold child awaiting it takes no other request's load);
    13. a request looked up again before vLLM allocated it (its blocks did not fit, or the
        step's budget ran out) gets the root's answer of the lookup before, unless a leaf
        answered it differently or the root's own state moved meanwhile (a child out of
        lookups, another request's load given out or timed: ``fastest``'s queues and lines).

    and on a model with several KV cache groups (``by_request``: the ``hma-*`` shapes), where
    vLLM's ``Scheduler._handle_invalid_blocks`` raises on any invalid block id and a sync
    load has no request-level failure signal, so the node parks every sync load (told to
    vLLM as async, a stitched load of one segment) and its worker half reports the round's
    receive itself; 3 to 8 hold with every load a stitched load, and:

    10'. no block id ever goes up as invalid; a load round with a failed part (a loader's
         failed receive or sync load, bad blocks it named, a raise that failed its loads)
         goes up in ``failed_recving`` unless a next round (another child's reload) follows;
    7'.  at the end no KV cache group holds a block of any request.
    """

    h: Any
    gen: Gen | None
    scripts: dict[str, Script]
    cursor: dict[str, int]
    behaviour: dict[str, dict[str, Behaviour]]
    breaking: set[str]
    loads: dict[str, set[str]]
    reported: dict[str, set[str]]
    last_lookup: dict[tuple[str, str], int]
    stitched: set[str]
    delayers: dict[str, set[str]]
    sent: dict[str, set[str]]
    root_recv: Counter[str]
    root_sent: Counter[str]
    async_loads: Counter[str]
    steps: int
    dead: bool
    propagating: bool
    raise_log: list[tuple[str, str, str]]
    worker_raisers: set[str]
    lost_bad: dict[str, set[int]]
    fenced: set[tuple[str, str]]
    last_hit: dict[tuple[str, str], int]
    cut_back_async: set[str]
    async_scheduling: bool
    last_answer: dict[str, tuple[Any, ...]]
    by_request: bool
    seg_failed: set[str]

    def do_step(self) -> Any:
        raise NotImplementedError

    # -------------------------------------------------------------- observation
    def watch_answers(self) -> None:
        """(13) Hold every root answer against the one before for a request looked up again
        before its allocation: the leaves' calls for it in each lookup, and the root's state
        that prices a plan, must differ where the answer does."""
        root = self.h.connector
        lookup = root.scheduler_side.lookup
        answer = lookup.answer

        def watched(request: Any, local: int) -> Any:
            rid = request.request_id
            record = root.ledger.get(rid)
            repeat = record is not None and record.state.value == "owned"
            marks = {name: len(s.calls) for name, s in self.scripts.items()}
            state = self.pricing_state(rid)
            out = answer(request, local)
            asked = tuple(
                (name, call)
                for name, s in self.scripts.items()
                for call in s.calls[marks[name] :]
                if call[0] in ("lookup", "hit", "raise")
                and call[-1 if call[0] == "raise" else 1] == rid
            )
            before = self.last_answer.get(rid)
            if repeat and before is not None and before[1:] == (local, asked, state):
                check(
                    out == before[0],
                    f"{rid}: looked up again before its allocation, with the same answers "
                    f"from every leaf, it got {out}, the lookup before {before[0]}",
                )
                STATS["lookups.repeated_same"] += 1
            self.last_answer[rid] = (out, local, asked, state)
            return out

        lookup.answer = watched

    def pricing_state(self, rid: str) -> tuple[Any, ...]:
        """What the root's answer reads besides its leaves' answers: its children out of
        lookups, the request's failed children, and (``fastest``) the lines, the prefill
        speed and the loads awaiting their times of every other request."""
        side = self.h.connector.scheduler_side
        record = side.ledger.get(rid)
        excluded = record.excluded if record is not None else frozenset()
        costs = side.costs
        if costs is None:
            return (frozenset(side.guard.disabled), excluded)
        lines = tuple(
            (c.latency_s, c.tokens_per_s, c.measured, c.worst_tokens_per_s, c.last_tokens)
            for c in costs.loads
        )
        waiting = frozenset(k for k in costs.expected if k[0] != rid)
        return (
            frozenset(side.guard.disabled),
            excluded,
            lines,
            costs.prefill_tokens_per_s,
            waiting,
        )

    def scan(self) -> dict[str, set[tuple[str, bool]]]:
        """Read the leaves' new call records; returns this step's recv reports by request."""
        recv: dict[str, set[tuple[str, bool]]] = defaultdict(set)
        ranges: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # this batch's loads
        new_async: dict[str, set[str]] = defaultdict(set)
        self.step_worker_raises: set[tuple[str, str]] = set()  # (leaf, method), contained
        self.step_bad_blocks: dict[str, set[int]] = defaultdict(set)  # leaf -> found bad
        # leaf -> (bad blocks, the requests whose loads they belong to), as reported
        self.step_bad_reports: dict[str, list[tuple[set[int], tuple[str, ...]]]] = defaultdict(list)
        self.step_recovery_allocs: set[str] = set()  # a load's next round (several groups)
        sync_lost: set[int] = set()  # bad blocks of sync loads, lost with a raise
        lost_calls: list[tuple[Any, str, tuple[int, ...], tuple[str, ...]]] = []
        fail_leaves = self.gen.fail_leaves if self.gen is not None else frozenset()
        for name, s in self.scripts.items():
            calls = s.calls[self.cursor[name] :]
            self.cursor[name] = len(s.calls)
            for call in calls:
                kind = call[0]
                if kind == "alloc" and call[2] > 0:
                    rid = call[1]
                    b = s.behaviour(rid)
                    # (11) a child loads no more than its lookup answered it holds
                    hit = self.last_hit.get((name, rid), 0)
                    check(
                        call[2] <= hit,
                        f"{rid}: {name} was allocated {call[2]} tokens to load, its lookup "
                        f"answered {hit}",
                    )
                    if b.stores:
                        STATS["loads.from_stored_prefix"] += 1
                    STATS["loads.async" if b.is_async else "loads.sync"] += 1
                    start = self.last_lookup.get((name, rid), 0)
                    ranges[rid].append((start, start + call[2], name))
                    # several KV cache groups: every load goes up as async (a sync one is
                    # parked: a stitched load of one segment), its receive the root's own
                    if b.is_async or self.by_request:
                        if rid in self.loads:
                            self.step_recovery_allocs.add(rid)
                        check(
                            rid not in self.loads or self.held_for_recovery(rid),
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
                elif kind == "sync_load" and self.by_request:
                    # parked: the step ends its part; a failure shows as the bad blocks it
                    # names (none, if all its blocks are the null block: nothing to fail)
                    recv[call[1]].add((name, False))
                elif kind == "send_report":
                    self.sent[call[1]].add(name)
                elif kind == "raise":
                    method, rid = call[1], call[2]
                    self.raise_log.append((name, method, rid))
                    STATS[f"raises.{method}"] += 1
                    # (9) an on_error: fail child's error goes through to vLLM
                    check(
                        name not in fail_leaves or self.propagating,
                        f"{name} (on_error: fail) raised in {method} for {rid}, "
                        "but the error did not reach vLLM",
                    )
                    if method in WORKER_RAISES and name not in fail_leaves:
                        self.step_worker_raises.add((name, method))
                        self.worker_raisers.add(name)
                elif kind == "invalid_report":
                    self.step_bad_reports[name].append((set(call[1]), call[2]))
                elif kind == "invalid_lost":
                    # judged below, once this batch's loads are known: a segment of a stitched
                    # load that starts in this very step is parked like any other
                    lost_calls.append((s, name, call[1], call[2]))
                elif kind == "hit":
                    self.last_hit[(name, call[1])] = call[2]
                elif kind == "stored":
                    whole, prompt_len = call[2], call[3]
                    part = "none" if not whole else "prompt" if whole == prompt_len else "part"
                    STATS[f"stores.{part}"] += 1
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
            if self.by_request:  # every load is parked or async: stitched rounds
                self.stitched.add(rid)
            elif len(ranges[rid]) == 1 and rid not in self.loads:  # not a recovery's reload
                self.stitched.discard(rid)
        for rid, names in new_async.items():
            if rid not in self.loads:  # a recovery's round adds no receive
                self.async_loads[rid] += 1
            self.loads[rid] = names
            self.reported.pop(rid, None)
        for s, name, bad, rids in lost_calls:
            for rid in rids:
                if self.hidden_load_error(name, rid):
                    continue  # as a hidden bad report: the node reloads or gives up
                if name in self.loads.get(rid, ()):  # its async load: checked when received
                    # (not another leaf's: under async scheduling a request preempted after its
                    # sync load's batch was scheduled can be looked up again, and load async
                    # from another leaf, before that batch's output comes back)
                    self.lost_bad.setdefault(rid, set()).update(bad)
                elif not s.behaviour(rid).is_async:
                    sync_lost.update(bad)
                # else: a late report of a load the composite already failed
        if sync_lost:
            self.step_bad_blocks["(lost with a raise)"].update(sync_lost)
        return recv

    def held_for_recovery(self, rid: str) -> bool:
        """A stitched load whose loaders all reported, with no receive shown to vLLM: the
        node held it back for a recovery round (a failed segment reloaded or given up)."""
        owners = self.loads.get(rid)
        return rid in self.stitched and owners is not None and owners <= self.reported[rid]

    def hidden_load_error(self, name: str, rid: str) -> bool:
        """... except where the node must hide a load's bad blocks from vLLM: a segment of a
        parked stitched load (the scheduler half reloads or gives up its range,
        test_stitch_recovery.py), and a late report of a load the node already failed for
        the leaf's raise (fenced: vLLM has freed or cut back those blocks)."""
        return (name, rid) in self.fenced or (rid in self.stitched and rid in self.loads)

    # --------------------------------------------------------------- invariants
    def check_step(self, result: Any) -> None:
        fenced_before = set(self.fenced)
        reports = self.scan()
        out = result.kv_connector_output
        recving = set(out.finished_recving or ()) if out is not None else set()
        failed = set(out.failed_recving or ()) if out is not None else set()
        sending = set(out.finished_sending or ()) if out is not None else set()
        clean = self.gen is not None and not self.gen.breakers
        check(failed <= recving, f"failed_recving {failed - recving} without finished_recving")
        reported = {(name, rid) for rid, reps in reports.items() for name, _ in reps}
        self.expect_worker_raise_failures(reports)
        invalid = set(out.invalid_block_ids or ()) if out is not None else set()
        if self.by_request:
            # (10, several KV cache groups) no block id ever goes up (vLLM's
            # Scheduler._handle_invalid_blocks raises); a failed part of a load fails the
            # request's load unless another child reloads it (checked at the receive)
            check(not invalid, f"invalid block ids {sorted(invalid)} went up to vLLM")
            self.note_failed_rounds(reports, fenced_before)
        # (10) no garbage: blocks a child found bad reach vLLM as invalid in that step, also
        # when the child raised while reporting them (its loads fail) ...
        found = [(name, bad, "") for name, bad in self.step_bad_blocks.items()]
        if self.by_request:
            found = []
        for name, bad_reports in self.step_bad_reports.items():
            for bad, rids in bad_reports:
                if self.by_request:
                    break
                if not all(self.hidden_load_error(name, rid) for rid in rids):
                    found.append((name, bad, f" in loads of {', '.join(rids)}"))
        for name, bad, where in found:
            check(
                bad <= invalid,
                f"{name} found blocks {sorted(bad - invalid)} bad{where}, but they did not "
                f"reach vLLM as invalid (invalid this step: {sorted(invalid)})",
            )
        self.fenced -= reported  # a fence ends with the late receive's step
        if invalid and self.async_scheduling:
            self.note_cut_back_running(invalid)
        # (3a) a request that finished while its async load was in flight, with a child
        # delaying the free, gets one terminal signal: the owner's receive is merged into the
        # finished_sending (vLLM would free on the first of two and assert on the second)
        held = [r for r in self.loads if r not in reports and self.held_for_recovery(r)]
        for rid, reps in [*reports.items(), *((r, set()) for r in held)]:
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
                self.lost_bad.pop(rid, None)
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
                (bool(owners & reporters) or rid in self.stitched)  # a recovery's last round
                and owners <= self.reported[rid] | reporters,
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
            if self.by_request:
                # (10, several KV cache groups) a load with a failed part that no child
                # reloaded goes up failed, by request (an aborted one only frees its blocks)
                check(
                    rid not in self.seg_failed
                    or rid in failed
                    or self.h.requests[rid].is_finished()
                    or not clean,
                    f"{rid}: a loader reported its part of the load failed, no child "
                    "reloaded it, and the load went up good",
                )
                self.seg_failed.discard(rid)
                STATS["root.by_request_recv"] += 1
            elif rid in self.stitched:
                # a stitched load (one KV cache group): a failed segment goes up as invalid
                # blocks with the one receive, never as failed_recving
                check(rid not in failed, f"{rid}: a stitched load went up in failed_recving")
                STATS["root.stitched_recv"] += 1
            lost = self.lost_bad.pop(rid, set())
            # (an aborted request's receive only frees its blocks: nothing reads that KV)
            check(
                not lost or rid in failed or lost <= invalid or self.h.requests[rid].is_finished(),
                f"{rid}: its loader raised while naming blocks {sorted(lost)} bad, but its "
                "load went up as good",
            )
            del self.loads[rid]
            self.reported.pop(rid, None)
            self.root_recv[rid] += 1
            if rid in failed:
                STATS["root.failed_recving"] += 1
        if clean:
            for rid in reports:
                owners = self.loads.get(rid)
                if owners and owners <= self.reported[rid] and rid not in self.stitched:
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
        self.check_tables(frozenset(recving))

    def note_failed_rounds(
        self, reports: dict[str, set[tuple[str, bool]]], fenced_before: set[tuple[str, str]]
    ) -> None:
        """Several KV cache groups: the requests whose current load round had a part fail in
        this step (a loader's failed receive or sync load, bad blocks it named, a raise that
        failed its loads); a next round (a reload) starts afresh. Late reports of loads the
        node already failed for a raise (fenced) are not the current round's."""
        failed: set[str] = set()
        for rid, reps in reports.items():
            for name, bad in reps:
                if bad and name in self.loads.get(rid, ()) and (name, rid) not in fenced_before:
                    failed.add(rid)
        for name, bad_reports in self.step_bad_reports.items():
            for bad, rids in bad_reports:
                failed.update(
                    rid
                    for rid in rids
                    if bad and name in self.loads.get(rid, ()) and (name, rid) not in fenced_before
                )
        self.seg_failed -= self.step_recovery_allocs
        self.seg_failed |= failed
        STATS["rounds.failed_part"] += len(failed)
        STATS["rounds.reloaded"] += len(self.step_recovery_allocs)

    def expect_worker_raise_failures(self, reports: dict[str, set[tuple[str, bool]]]) -> None:
        """A child's contained worker-side raise while loading fails its async loads in flight
        (those it reports in that step too) and no other's: each counts as a failed report from
        it in that step; its own later receives for them are dropped."""
        unbound = self.unbound_loads() if self.step_worker_raises else set()
        for name, method in sorted(self.step_worker_raises):
            STATS[f"worker_raise.{method}"] += 1
            in_flight = {
                rid
                for rid, owners in self.loads.items()
                if name in owners and name not in self.reported[rid] and rid not in unbound
            }
            if method in FAILS_LOADS:
                for rid in in_flight:
                    reports[rid].add((name, True))
                    self.fenced.add((name, rid))
                    STATS["worker_raise.failed_loads"] += 1

    def unbound_loads(self) -> set[str]:
        """Async scheduling: requests whose load is in a batch scheduled but not run yet (the
        worker has not seen it)."""
        unbound: set[str] = set()
        for so, _ in getattr(self.h, "in_flight", ()):
            md = so.kv_connector_metadata
            unbound |= set(md.loads) | set(md.stitches)
        return unbound

    def harness_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the harness; an error that escapes it must be the first error an
        ``on_error: fail`` leaf raised in the call, with a note naming that leaf and method
        (9). Then the engine is dead (``self.dead``) and None is returned."""
        mark = len(self.raise_log)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            fail_leaves = self.gen.fail_leaves if self.gen is not None else frozenset()
            self.propagating = True
            try:
                self.scan()
            finally:
                self.propagating = False
            fatal = [r for r in self.raise_log[mark:] if r[0] in fail_leaves]
            if not fatal:
                raise
            name, method, rid = fatal[0]
            check(
                str(exc) == f"scripted failure in {method} for {rid}",
                f"{exc!r} reached vLLM, not {name}'s first error ({method} for {rid})",
            )
            notes = getattr(exc, "__notes__", [])
            check(
                bool(notes) and f"child {name!r} raised in {method}" in notes[0],
                f"{name}'s error reached vLLM without naming it and {method}: notes {notes}",
            )
            STATS["on_error_fail.reached_vllm"] += 1
            self.dead = True
            return None

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

    def check_tables(self, received: frozenset[str] = frozenset()) -> None:
        """(5) ledgers hold no finished request; (6) violations / errors; (12) no load time
        awaited for a finished request or one whose receive vLLM saw (``received``, this
        step's)."""
        clean = self.gen is not None and not self.gen.breakers
        live = {rid for rid, req in self.h.requests.items() if not req.is_finished()}
        for node in composites(self.h.connector):
            stray = set(node.ledger.snapshot()) - live
            check(not stray, f"node {node.name}: ledger holds finished requests {sorted(stray)}")
            costs = node.scheduler_side.costs
            if costs is not None:
                waiting = {rid for (rid, _), e in costs.expected.items() if e.is_async}
                stale = waiting - (live - received)
                check(
                    not stale,
                    f"node {node.name}: awaits load times of {sorted(stale)}, finished or received",
                )
        if clean:
            live = self.h.worker_connector.signals.live()
            in_flight = set(live.get("loads_in_flight", {})) | set(
                live.get("stitches_in_flight", {})
            )
            expected = {rid for rid in self.loads if not self.held_for_recovery(rid)}
            check(
                in_flight == expected - self.unbound_loads(),
                f"worker loads in flight {sorted(in_flight)} != async loads not yet "
                f"received {sorted(self.loads)}",
            )
        for side in (self.h.connector, self.h.worker_connector):
            for node in composites(side):
                if clean:
                    violations = dict(node.guard.violations)
                    check(
                        not violations,
                        f"node {node.name} ({node.role.name}): violations from "
                        f"contract-obeying children: {dict(node.guard.violations)}",
                    )
                for _, where in node.guard.errors:
                    method = where.split(":")[0]
                    check(
                        method in SCHEDULER_RAISES or method in WORKER_RAISES,
                        f"node {node.name}: unexpected child error {where}",
                    )

    # ------------------------------------------------------------------ the end
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

    def note_cut_back_running(self, invalid: set[int]) -> None:
        """Running requests vLLM cut back for invalid blocks under async scheduling: the
        ones its placeholder leak (below) can strand."""
        manager = self.h.scheduler.kv_cache_manager
        for req in self.h.scheduler.running:
            if invalid.intersection(manager.get_block_ids(req.request_id)[0]):
                self.cut_back_async.add(req.request_id)

    def abort_leaked_placeholders(self) -> bool:
        """vLLM's own liveness bug under async scheduling (0.32 and 0.33; see
        test_regressions.py): a running request cut back by a sync load's invalid blocks
        keeps the output placeholder of the batch whose output vLLM skipped for it, and once
        it has no batch in flight it is never scheduled again. Such requests (cut back while
        running, a placeholder but no batch in flight) are aborted and counted, so the
        machine keeps checking kvcompose under async scheduling; returns whether any was."""
        if not self.async_scheduling:
            return False
        in_flight = {r for so, _ in self.h.in_flight for r in so.num_scheduled_tokens}
        stuck = [
            rid
            for rid in sorted(self.cut_back_async)
            if (req := self.h.scheduler.requests.get(rid)) is not None
            and req.status.name == "RUNNING"
            and req.num_output_placeholders > 0
            and rid not in in_flight
        ]
        if stuck:
            STATS["vllm_bug.leaked_placeholder_aborted"] += len(stuck)
            self.h.abort(*stuck)
        return bool(stuck)

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
            if result is None:
                return  # an on_error: fail child's error reached vLLM: the engine is dead
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
            if idle >= IDLE_STEPS and (
                self.abort_stale_inflight_prefills() | self.abort_leaked_placeholders()
            ):
                idle = 0
                limit = drained + self.drain_budget()
        STATS["drain_steps"] += drained
        STATS["max_drain_steps"] = max(STATS["max_drain_steps"], drained)
        if self.gen is not None and (self.gen.breakers or self.worker_raisers):
            # (also after a contained worker-side raise: the child's transfers for the loads
            # the composite failed go on, and report late)
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
        managers = self.h.scheduler.kv_cache_manager.coordinator.single_type_managers
        for group, manager in enumerate(managers):
            held = sorted(rid for rid, blocks in manager.req_to_blocks.items() if blocks)
            check(not held, f"KV cache group {group} still holds blocks of {held}")
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
