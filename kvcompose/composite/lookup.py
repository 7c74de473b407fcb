"""The lookup of a chain, fan-out or route node (scheduler side): it asks the children, checks
their answers through the guard, and records the decision; its policy
(``kvcompose.composite.policies``) says which children are asked, where, and how their
answers become the plan.

vLLM asks ``get_num_new_matched_tokens`` for every waiting request every step, with the
block-aligned local hit, and takes one ``(n, async)`` (``Scheduler.schedule``). The general
rule is ``Lookup.plan``: the policy's candidates are asked in order, each where the policy
says, each answer through the guard, and the hits the policy takes become the *plan*, a tuple
of segments (``kvcompose.composite.segments``): one segment is an owner's load, several a
stitched load (``kvcompose.composite.stitch``), none a miss.

A child still answering ``None`` holds the decision (``longest`` and ``fastest`` ask the rest
first) until it answers or the node's lookup deadline passes. A sync plan always leaves vLLM
one token to compute (``Guard.leave_one_token``); an async one need not (vLLM recomputes the
last token after the receive, ``Scheduler._update_waiting_for_remote_kv``).

On several KV cache groups the node plans under ``park_only``: vLLM takes no block-level
load failure there (``Scheduler._handle_invalid_blocks`` raises), so the scheduler half tells
vLLM every sync load is async (``Ledger.park``) and reports a failure by request; a child
whose range mode cannot be parked (``PARKABLE_MODES``) would load only what vLLM schedules,
so its sync hits are not taken (counted ``not_parked.<child>``), and the next candidate is
asked as if it had missed.

A child that must be asked about every request (``LMCacheMPConnector`` makes a request's
tracker in its lookup and asserts on a request it never saw, in ``update_state_after_alloc``
and in ``build_connector_meta``), or a nested node holding one, is asked after the plan when
the plan did not ask it: a route's other children, a fan-out's, the children after a stitch's
covering segment or a ``first`` hit, children out of lookups (``Lookup.ask_the_rest``). Its
answer is not taken: it is told 0 at the allocation (``LMCacheMPConnector`` cancels its
prefetch). While it answers ``None`` the decision waits, as vLLM's ``MultiConnector`` waits
for every child, up to the lookup deadline.

``Lookup.answer`` is what vLLM calls. Its common case (a request the node holds no record of,
fixed candidates all asked at the local hit, no child out of lookups, no debug trace, nothing
``park_only`` would skip) is one loop: every candidate asked with the guard's checks inlined,
and the hits handed to the policy's ``settle``, which decides as ``plan`` would;
``tests/composite/test_hot_paths.py`` checks the two against each other on random answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose import tree as nodes
from kvcompose.composite.ledger import PARKABLE_MODES, UNALLOCATED, LoadState
from kvcompose.composite.policies.base import (
    MISS,
    PENDING,
    Answer,
    Candidates,
    Hit,
    LookupPolicy,
    Pending,
    Plan,
)
from kvcompose.composite.policies.factory import asked_every_request
from kvcompose.composite.segments import Segment

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.composite.children import Children
    from kvcompose.composite.ledger import Ledger, LoadRecord
    from kvcompose.composite.stats import NodeCounters

logger = logging.getLogger("kvcompose")


def same_decision(record: LoadRecord, found: Plan, local: int) -> bool:
    """Whether ``found`` is the plan ``record`` holds from the last lookup. A parked sync load
    (``Ledger.park``) is held as a stitched load of its one segment: the same segment."""
    if record.local_tokens != local:
        return False
    if len(found) > 1 or record.segments:
        return record.segments == found
    if not found:
        return record.owner is None
    segment = found[0]
    return (record.owner, record.tokens, record.is_async) == (
        segment.child,
        segment.tokens,
        segment.is_async,
    )


def well_formed(result: Any) -> bool:
    """``(n > 0, async)`` or ``(0, False)``: the answers taken without the guard's checks
    (``Lookup.answer`` inlines the same test)."""
    if type(result) is not tuple or len(result) != 2:
        return False
    tokens, is_async = result
    return type(tokens) is int and (tokens > 0 or not is_async)


def deadline_and_exclusions(
    record: LoadRecord | None, timeout_s: float
) -> tuple[bool, frozenset[int]]:
    """Whether a request's lookup deadline has passed since it was last allocated (pending,
    or decided and asked again: ``Ledger.mark_pending``), and the children whose load of it
    failed (skipped)."""
    if record is None:
        return False, frozenset()
    timed_out = (
        record.state in UNALLOCATED
        and record.pending_since is not None
        and time.monotonic() - record.pending_since >= timeout_s
    )
    return timed_out, record.excluded


class Lookup:
    """The lookup of one node's scheduler half: asking, guarding and recording, for any
    policy."""

    def __init__(
        self,
        name: str,
        tree: nodes.Composite,
        children: Children,
        counters: NodeCounters,
        ledger: Ledger,
        block_size: int,
        policy: LookupPolicy,
    ) -> None:
        self.name = name
        self.children = children
        self.guard = children.guard
        self.counters = counters
        self.ledger = ledger
        self._ledger_ids = ledger.ids
        self.block_size = block_size
        self.policy = policy
        policy.attach(self)
        self.range_supports = policy.supports
        self.fixed_candidates: Candidates | None = policy.fixed
        self.lookup_timeout_s = tree.lookup_timeout_s
        #: the children whose sync hits are not taken (``park_only``)
        self.unparkable: frozenset[int] = frozenset()
        self._not_parked_logged: set[int] = set()
        self.debug = logger.isEnabledFor(logging.DEBUG)
        self.lookups: Sequence[Callable[[Request, int], Any]] = ()
        self._asks: tuple[tuple[int, Callable[[Request, int], Any]], ...] | None = None
        self._fast_asks: tuple[tuple[int, Callable[[Request, int], Any]], ...] | None = None
        self._checked_misses: list[object] = []
        # the common case's policy settings, read once (fixed for the node's life)
        self._stops_at_hit = policy.stops_at_hit
        self._stops_at_pending = policy.stops_at_pending
        self._weighs_every_hit = policy.weighs_every_hit
        #: the children asked about every request whatever the plan (``ask_the_rest``)
        self.asked_every_request = asked_every_request(tree)
        self.guard.on_disable.append(self._choose_path)

    def park_only(self) -> None:
        """Plan for a node on several KV cache groups, whose sync loads are parked
        (``Ledger.park``): a sync hit of a child whose range mode cannot be parked is not
        taken, and the common case is left to the general rule while any child's could be."""
        self.unparkable = frozenset(
            i for i, s in enumerate(self.range_supports) if s.mode not in PARKABLE_MODES
        )
        self._choose_path()

    def refresh(self, lookups: Sequence[Callable[[Request, int], Any]]) -> None:
        """Take the children's (re-)cached ``get_num_new_matched_tokens`` methods."""
        self.lookups = lookups
        fixed = self.fixed_candidates
        self._asks = (
            tuple((i, lookups[i]) for i in fixed.children)
            if fixed is not None and self.policy.has_fast_path and self._fast_path_asks_all(fixed)
            else None
        )
        # per child, the last miss it answered, if that was a tuple ``(0, False)``: a child
        # answering the same object again answered the same (a tuple of an int and a bool
        # cannot change), so it is not checked again
        self._checked_misses = [None] * len(lookups)
        self._choose_path()

    def _fast_path_asks_all(self, fixed: Candidates) -> bool:
        """Whether the common case asks every child that must be asked about every request
        (it asks every fixed candidate unless the policy stops at the first hit)."""
        must = self.asked_every_request
        return not must or (not self._stops_at_hit and must <= set(fixed.children))

    def set_debug(self, debug: bool) -> None:
        if debug is not self.debug:
            self.debug = debug
            self._choose_path()

    def _choose_path(self) -> None:
        """The fast path's candidates, or None where every lookup takes ``decide``: stitch and
        route, a debug trace, a child out of lookups, a child ``park_only`` skips."""
        fast = not (self.debug or self.guard.disabled or self.unparkable)
        self._fast_asks = self._asks if fast else None

    # ------------------------------------------------------ what policies call back
    def leave_one(self, child: int, request: Request, at: int, tokens: int) -> int:
        """A sync answer reaching the end of ``request``, cut so that vLLM has one token left
        to compute (``Guard.leave_one_token``): to any token for a child whose load can be cut
        short, to a block boundary otherwise."""
        end = request.num_tokens - 1
        if not self.range_supports[child].can_cut:
            end -= end % self.block_size
        return self.guard.leave_one_token(child, at, tokens, request.num_tokens, max(end - at, 0))

    def ask(self, child: int, request: Request, at: int) -> Answer:
        """One child's lookup at ``at``, through the guard (a raise is a miss)."""
        try:
            result = self.lookups[child](request, at)
        except Exception as exc:
            self.guard.child_error(child, "get_num_new_matched_tokens", exc)
            return MISS
        if well_formed(result):
            return result  # type: ignore[no-any-return]
        return self.guard.normalise_lookup(child, result)

    def record(
        self,
        req_id: str,
        found: Plan,
        reason: str,
        local: int,
        record: LoadRecord | None,
        *,
        counted: bool = True,
    ) -> tuple[int, bool]:
        """The decided plan counted (unless it repeats the last one: ``decide``), handed to
        the policy (``LookupPolicy.decided``) and recorded in the ledger (a plain miss of a
        request without a record needs none); vLLM's answer."""
        if counted:
            for segment in found:
                self.counters.hit(segment.child, segment.tokens)
        self.policy.decided(req_id, found, counted)
        if len(found) > 1:
            stitched = self.ledger.decide_stitch(req_id, found, reason, local)
            return stitched.tokens, stitched.is_async
        if found:
            segment = found[0]
            self.ledger.decide(
                req_id, segment.child, segment.tokens, segment.is_async, reason, local
            )
            return segment.tokens, segment.is_async
        if record is not None:
            self.ledger.decide(req_id, None, 0, False, reason, local)
        return MISS

    # ------------------------------------------------------------------ the rule
    def plan(
        self,
        request: Request,
        local: int,
        candidates: Candidates,
        excluded: frozenset[int],
        timed_out: bool,
        trace: list[str] | None,
        timeouts: list[int],
        not_parked: list[int] | None = None,
        asked: list[int] | None = None,
    ) -> Plan | Pending:
        """Ask the candidates in order; the hits the policy takes become the plan (see the
        module docstring). ``timeouts``, ``not_parked`` and ``asked`` receive the children
        that missed the deadline, whose sync hits were not taken (``park_only``), and that
        were asked."""
        policy = self.policy
        names = self.children.names
        disabled = self.guard.disabled
        unparkable = self.unparkable
        shows_start = policy.asks_where_plan_ends
        found: list[Segment] = []
        pending = False
        for child in candidates.children:
            if child in disabled:
                continue
            if child in excluded:
                if trace is not None:
                    trace.append(f"{names[child]}=excluded(failed)")
                continue
            at = policy.start(local, found)
            if why := policy.cannot_ask(child, at, found):
                if trace is not None:
                    trace.append(f"{names[child]}={why}")
                continue
            tokens, is_async = self.ask(child, request, at)
            if asked is not None:
                asked.append(child)
            if trace is not None:
                where = f"@{at}" if shows_start else ""
                trace.append(f"{names[child]}{where}={tokens}{'a' if is_async and tokens else ''}")
            if tokens is None:
                if timed_out:
                    timeouts.append(child)
                    continue
                pending = True
                if policy.stops_at_pending:
                    break
                continue
            if tokens <= 0:
                continue
            if policy.synced(is_async, found) and at + tokens >= request.num_tokens:
                tokens = self.leave_one(child, request, at, tokens)
                if tokens <= 0:
                    continue
            if not is_async and child in unparkable:
                if not_parked is not None:
                    not_parked.append(child)
                if trace is not None:
                    trace.append(f"{names[child]}=not taken(sync, cannot be parked)")
                continue
            support = self.range_supports[child]
            segment = Segment(child, at, at + tokens, is_async, support.mode, support.can_cut)
            if why := policy.refuses(segment, found):
                if trace is not None:
                    trace.append(f"{names[child]}={why}")
                continue
            if policy.take(found, segment):
                break
        if pending:
            return PENDING
        return policy.finish(request, local, found, trace)

    def decide(self, request: Request, local: int, record: LoadRecord | None) -> Answer:
        """The node's answer for ``request`` in any state, by ``plan``; recorded in the
        ledger (a plain miss of a request without a record needs none).

        A request still ``OWNED`` is asked again because vLLM did not allocate it (its
        blocks did not fit, or the step's budget ran out: ``Scheduler.schedule`` keeps it
        waiting): the plan it was given never started. It is priced without that plan (its
        own planned async load is no queue in front of itself), and the same plan again is
        counted as a repeat, not as a new lookup and hit."""
        req_id = request.request_id
        repeat = record is not None and record.state is LoadState.OWNED
        if repeat:
            self.policy.repeat(req_id)
        timed_out, excluded = deadline_and_exclusions(record, self.lookup_timeout_s)
        candidates = self.fixed_candidates or self.policy.candidates(request)
        trace: list[str] | None = [] if self.debug else None
        timeouts: list[int] = []
        not_parked: list[int] = []
        asked: list[int] | None = [] if self.asked_every_request else None
        found = self.plan(
            request, local, candidates, excluded, timed_out, trace, timeouts, not_parked, asked
        )
        if (
            asked is not None
            and not isinstance(found, Pending)
            and self.ask_the_rest(request, local, asked, timed_out, trace, timeouts)
        ):
            found = PENDING
        if isinstance(found, Pending):
            self.ledger.mark_pending(req_id, time.monotonic())
            return None, False
        for child in timeouts:
            self.counters.lookup_timeout(child)
        reason = candidates.reason
        if timeouts:
            reason += "+deadline"
        if excluded:
            reason += "+fallback"
        if not_parked:
            self._not_parked(not_parked)
            reason += "+not parked"
        counted = not (repeat and same_decision(record, found, local))  # type: ignore[arg-type]
        if counted:
            self.counters.lookups += 1
        else:
            self.counters.inc("lookup_repeats")
        tokens, is_async = self.record(req_id, found, reason, local, record, counted=counted)
        if trace is not None:
            names = self.children.names
            if len(found) > 1:
                chosen = " + ".join(f"{names[s.child]}[{s.start},{s.end})" for s in found)
            else:
                chosen = f"owner {names[found[0].child] if found else 'none'}"
            logger.debug(
                "kvcompose[%s] %s: asked [%s] → %s, %d tokens%s, by %s",
                self.name,
                req_id,
                ", ".join(trace),
                chosen,
                tokens,
                " async" if is_async else "",
                reason,
            )
        return tokens, is_async

    def ask_the_rest(
        self,
        request: Request,
        local: int,
        asked: list[int],
        timed_out: bool,
        trace: list[str] | None,
        timeouts: list[int],
    ) -> bool:
        """Ask each child that must be asked about every request and that the plan did not
        ask (see the module docstring); its answer is not taken. True: one of them is still
        looking, and the decision waits (past the deadline it is counted a timeout)."""
        pending = False
        for child in sorted(self.asked_every_request.difference(asked)):
            tokens, _ = self.ask(child, request, local)
            if trace is not None:
                trace.append(f"{self.children.names[child]}={tokens}(asked, not taken)")
            if tokens is None:
                if timed_out:
                    timeouts.append(child)
                else:
                    pending = True
        return pending

    def _not_parked(self, children: list[int]) -> None:
        """Count (and log once per child) the sync hits ``park_only`` did not take."""
        names = self.children.names
        for child in children:
            self.counters.inc(f"not_parked.{names[child]}")
            if child not in self._not_parked_logged:
                self._not_parked_logged.add(child)
                logger.warning(
                    "kvcompose[%s]: child %r answered a sync load on a model with several KV "
                    "cache groups, where vLLM has no way to hear that a sync load failed, and "
                    "its range mode cannot be parked (told to vLLM as async); its sync hits "
                    "are not taken (logged once per child). Declare its load_range native if "
                    "it loads what its metadata names whether vLLM schedules the request or not",
                    self.name,
                    names[child],
                )

    # ------------------------------------------------------------ what vLLM calls
    def answer(self, request: Request, local: int) -> Answer:
        """``get_num_new_matched_tokens``: the common case answered here (every candidate
        asked at ``local`` with the guard's checks inlined, the hits decided by the policy's
        ``settle``), everything else by ``decide``."""
        asks = self._fast_asks
        if asks is None or request.request_id in self._ledger_ids:
            return self.decide(request, local, self.ledger.get(request.request_id))
        # the longest hit (the first of the longest), and every hit for a policy that
        # weighs them all
        best = -1
        best_end = 0
        best_async = False
        hits: list[Hit] | None = [] if self._weighs_every_hit else None
        any_async = False
        num_tokens = 0
        pending = False
        checked_misses = self._checked_misses
        for child, ask in asks:
            try:
                result = ask(request, local)
            except Exception as exc:
                self.guard.child_error(child, "get_num_new_matched_tokens", exc)
                continue  # a miss
            if result is checked_misses[child]:
                continue  # the very (immutable) answer that passed the checks before
            try:
                n, a = result
            except Exception:
                n = a = None  # not a pair: the guard says what it is
            # well formed (``well_formed``): taken as is
            if type(n) is not int or (n <= 0 and a) or type(result) is not tuple:
                n, a = self.guard.normalise_lookup(child, result)
                if n is None:
                    pending = True
                    if self._stops_at_pending:
                        break
                    continue
            elif n == 0 and a is False:
                checked_misses[child] = result  # a child answers its miss constant
                continue
            if n <= 0:
                continue
            if not a:
                if not num_tokens:
                    num_tokens = request.num_tokens  # (a property: read once, at a sync hit)
                if local + n >= num_tokens:
                    n = self.leave_one(child, request, local, n)
                    if n <= 0:
                        continue
            end = local + n
            if hits is not None:
                hits.append((child, end, a))
                if a:
                    any_async = True
            if end > best_end:
                best, best_end, best_async = child, end, a
                if self._stops_at_hit:
                    break
        if pending:
            self.ledger.mark_pending(request.request_id, time.monotonic())
            return None, False
        self.counters.lookups += 1
        if best < 0:
            return MISS  # a plain miss needs no record
        return self.policy.settle(
            request, local, best, best_end, best_async, hits, any_async, num_tokens
        )
