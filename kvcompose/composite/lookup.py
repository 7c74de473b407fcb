"""The one lookup rule of a chain, fan-out or route node (scheduler side): which children are
asked, where, who owns what they answer, and how the decision is recorded.

vLLM asks ``get_num_new_matched_tokens`` for every waiting request every step, with the
block-aligned local hit, and takes one ``(n, async)`` (``Scheduler.schedule``). Every policy
goes through ``Lookup.plan``: the candidates (``kvcompose.composite.policies``) are asked in
order, each child's answer goes through the guard, and the hits become the *plan*, a tuple of
segments (``kvcompose.composite.segments``):

- ``first`` and ``longest``: at most one segment, the owner's ``[local, local + n)``; who owns
  is ``Lookup.takes``, the one ownership rule;
- ``stitch``: each child that can start a segment where the earlier ones end (its
  ``kvcompose.tree.ranges`` mode and alignment allow it) is asked *there*, and each hit is a
  segment of one stitched load (``kvcompose.composite.stitch``);
- ``fastest``: every child is asked at ``local``, and the plan with the least predicted time
  to first token is taken (``kvcompose.composite.fastest``): no segment (recompute), one, or
  several, each segment that starts later asked again *there*, as a stitch asks.

A child still answering ``None`` holds the decision (``longest`` asks the rest first) until
it answers or the node's lookup deadline passes. A sync plan always leaves vLLM one token to
compute (``Guard.leave_one_token``); an async one need not (vLLM recomputes the last token
after the receive, ``Scheduler._update_waiting_for_remote_kv``).

``Lookup.answer`` is what vLLM calls. Its common case (a request the node holds no record of,
fixed candidates, ``first`` or ``longest``, no child out of lookups, no debug trace) is the
same rule unrolled for speed: it uses ``takes`` and ``leave_one_token`` too, and
``tests/composite/test_hot_paths.py`` checks it against ``plan`` on random answers.
``fastest``'s node answers by ``_answer_fastest`` instead (bound as ``answer`` on the
instance), its own common case checked the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcompose import tree as nodes
from kvcompose.composite import fastest
from kvcompose.composite.costs import Costs
from kvcompose.composite.ledger import UNALLOCATED, LoadState
from kvcompose.composite.policies import Candidates, RouteLookup, policy_for
from kvcompose.composite.segments import Segment
from kvcompose.tree.ranges import RangeSupport, known_range_support

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvcompose.composite.children import Children
    from kvcompose.composite.ledger import Ledger, LoadRecord
    from kvcompose.composite.stats import NodeCounters

logger = logging.getLogger("kvcompose")

#: A miss, as vLLM's contract spells it.
MISS = (0, False)
#: ``fastest``'s plan counters of a recompute and of one child's load
_PLAN_RECOMPUTE, _PLAN_LOAD = fastest.PLAN_COUNTERS[:2]

Answer = tuple[int | None, bool]
Plan = tuple[Segment, ...]


class Pending:
    """A child answered ``None`` before the lookup could decide."""


PENDING = Pending()


class Recompute(tuple):  # type: ignore[type-arg]
    """``fastest``'s plan of no load, chosen over hits (a miss without hits weighs nothing)."""


#: The recompute plan: an empty plan that ``fastest`` weighed and counts.
RECOMPUTE: Plan = Recompute()


def same_decision(record: LoadRecord, found: Plan, local: int) -> bool:
    """Whether ``found`` is the plan ``record`` holds from the last lookup."""
    if record.local_tokens != local:
        return False
    if len(found) > 1:
        return record.segments == found
    if record.segments:
        return False
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


def child_range_supports(tree: nodes.Composite) -> tuple[RangeSupport, ...]:
    """Each child's range support: a leaf's from its connector class and overrides, a nested
    composite as one owner."""
    return tuple(
        child.range_support() if isinstance(child, nodes.Leaf) else known_range_support(None)
        for child in tree.children
    )


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
    """The lookup of one node's scheduler half, for every policy."""

    def __init__(
        self,
        name: str,
        tree: nodes.Composite,
        children: Children,
        counters: NodeCounters,
        ledger: Ledger,
        block_size: int,
        *,
        ask_every_child: bool,
        costs: Costs | None = None,
    ) -> None:
        self.name = name
        self.children = children
        self.guard = children.guard
        self.counters = counters
        self.ledger = ledger
        self._ledger_ids = ledger.ids
        self.block_size = block_size
        self.policy = policy_for(tree)
        mode = self.policy.mode
        self.longest = mode == "longest"
        self.stitching = mode == "stitch"
        self.costs = costs  # ``fastest`` only
        # ``first`` stops at the first hit unless every child must be asked (vLLM's
        # MultiConnector does: a child that pins or prefetches on lookup relies on it);
        # the first hit still owns either way.
        self.stop_at_hit = not (self.longest or ask_every_child)
        # chain and fan-out ask the same children for every request
        fixed = not isinstance(self.policy, RouteLookup)
        self.fixed_candidates = self.policy.candidates(None) if fixed else None  # type: ignore[arg-type]
        self.lookup_timeout_s = tree.lookup_timeout_s
        self.range_supports = child_range_supports(tree)
        self.planner = (
            fastest.Planner(self.range_supports, block_size) if costs is not None else None
        )
        self.debug = logger.isEnabledFor(logging.DEBUG)
        self.lookups: Sequence[Callable[[Request, int], Any]] = ()
        self._asks: tuple[tuple[int, Callable[[Request, int], Any]], ...] | None = None
        self._fast_asks: tuple[tuple[int, Callable[[Request, int], Any]], ...] | None = None
        self._checked_misses: list[object] = []
        self.guard.on_disable.append(self._choose_path)
        if costs is not None:
            # ``fastest`` answers by its own path from the first call (one call level less on
            # every lookup than going through ``answer``'s test of the policy)
            self.answer = self._answer_fastest  # type: ignore[method-assign]

    def refresh(self, lookups: Sequence[Callable[[Request, int], Any]]) -> None:
        """Take the children's (re-)cached ``get_num_new_matched_tokens`` methods."""
        self.lookups = lookups
        fixed = self.fixed_candidates
        self._asks = (
            tuple((i, lookups[i]) for i in fixed.children)
            if fixed is not None and not self.stitching
            else None
        )
        # per child, the last miss it answered, if that was a tuple ``(0, False)``: a child
        # answering the same object again answered the same (a tuple of an int and a bool
        # cannot change), so it is not checked again
        self._checked_misses = [None] * len(lookups)
        self._choose_path()

    def set_debug(self, debug: bool) -> None:
        if debug is not self.debug:
            self.debug = debug
            self._choose_path()

    def _choose_path(self) -> None:
        """The fast path's candidates, or None where every lookup takes ``decide``: stitch and
        route, a debug trace, a child out of lookups."""
        fast = not (self.debug or self.guard.disabled)
        self._fast_asks = self._asks if fast else None

    # ------------------------------------------------------------------ the rule
    def takes(self, best: int, tokens: int) -> bool:
        """Who owns a hit (``first``, ``longest``): a hit of ``tokens`` replaces the owner so
        far (``best`` tokens, 0 while there is none) if it is the first, or, for ``longest``,
        longer (ties go to the earlier child)."""
        return tokens > best and (best == 0 or self.longest)

    def _leave_one(self, child: int, request: Request, at: int, tokens: int) -> int:
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

    def _cannot_start(self, child: int, covered: int, segments: list[Segment]) -> str | None:
        """Why ``child`` cannot start a stitch's segment at ``covered`` (None: it can)."""
        support = self.range_supports[child]
        if support.mode == "sole_owner" and segments:
            return "skipped(sole owner)"
        if support.mode == "natural_end" and any(s.is_async for s in segments):
            return "skipped(sync stitches only)"
        align = support.align or self.block_size
        if covered % align or covered % self.block_size:
            return f"skipped(start {covered} not on {align})"
        return None

    def plan(
        self,
        request: Request,
        local: int,
        candidates: Candidates,
        excluded: frozenset[int],
        timed_out: bool,
        trace: list[str] | None,
        timeouts: list[int],
    ) -> Plan | Pending:
        """Ask the candidates in order; the hits become the plan (see the module docstring)."""
        names = self.children.names
        disabled = self.guard.disabled
        stitching = self.stitching
        segments: list[Segment] = []
        hits: list[fastest.Hit] = []  # every hit (fastest)
        best = 0  # the owner's tokens so far (first, longest)
        covered = local  # where the next segment starts (stitch)
        pending = False
        for child in candidates.children:
            if child in disabled:
                continue
            if child in excluded:
                if trace is not None:
                    trace.append(f"{names[child]}=excluded(failed)")
                continue
            if stitching and (why := self._cannot_start(child, covered, segments)):
                if trace is not None:
                    trace.append(f"{names[child]}={why}")
                continue
            tokens, is_async = self.ask(child, request, covered)
            if trace is not None:
                at = f"@{covered}" if stitching else ""
                trace.append(f"{names[child]}{at}={tokens}{'a' if is_async and tokens else ''}")
            if tokens is None:
                if timed_out:
                    timeouts.append(child)
                    continue
                pending = True
                if self.longest or self.costs is not None:
                    continue
                break
            if tokens <= 0:
                continue
            support = self.range_supports[child]
            # sync, and (for a stitch) no earlier segment async: vLLM schedules right away
            synced = not (is_async or (stitching and any(s.is_async for s in segments)))
            if synced and covered + tokens >= request.num_tokens:
                tokens = self._leave_one(child, request, covered, tokens)
                if tokens <= 0:
                    continue
            segment = Segment(
                child, covered, covered + tokens, is_async, support.mode, support.can_cut
            )
            if stitching:
                if is_async and any(s.mode == "natural_end" for s in [*segments, segment]):
                    if trace is not None:
                        trace.append(f"{names[child]}=not taken(async in a sync-only stitch)")
                    continue
                segments.append(segment)
                covered += tokens
                if support.mode in ("sole_owner", "last_segment"):
                    break
            elif self.costs is not None:
                hits.append(fastest.Hit(child, covered + tokens, is_async))
            elif self.takes(best, tokens):
                segments, best = [segment], tokens
                if self.stop_at_hit:
                    break
        if pending:
            return PENDING
        if self.costs is not None:
            return self._fastest(request, local, hits, trace) if hits else ()
        return tuple(segments)

    def _fastest(
        self, request: Request, local: int, hits: list[fastest.Hit], trace: list[str] | None
    ) -> Plan:
        """``fastest``'s plan: the cheapest (``kvcompose.composite.fastest.Planner``); with a
        debug trace, every plan weighed is listed in it (the decision log)."""
        weighed: list[fastest.Choice] | None = [] if trace is not None else None
        choice = self.planner.choose(  # type: ignore[union-attr]
            request.request_id,
            hits,
            local,
            request.num_tokens,
            self.costs,  # type: ignore[arg-type]
            weighed,
        )
        if weighed is not None and trace is not None:
            names = self.children.names
            trace.append("plans: " + "; ".join(c.describe(names) for c in weighed))
        return self._realise(request, local, choice)

    def _realise(self, request: Request, local: int, choice: fastest.Choice) -> Plan:
        """The chosen plan's segments, each that starts after ``local`` asked again there;
        an answer that cannot carry the plan ends it there (the rest is recomputed). A part
        at ``local`` is its child's answer there, or (a child that can be cut) a cut of it:
        it is taken as planned."""
        plan: list[Segment] = []
        for part in choice.parts:
            support = self.range_supports[part.child]
            if part.start == local:
                plan.append(
                    Segment(
                        part.child, local, part.end, part.is_async, support.mode, support.can_cut
                    )
                )
                continue
            tokens, is_async = self.ask(part.child, request, part.start)
            if not tokens or tokens <= 0:
                break
            end = part.start + tokens
            if not is_async and end >= request.num_tokens:
                end = part.start + self._leave_one(part.child, request, part.start, tokens)
            if end < part.end or (end > part.end and not support.can_cut):
                if end <= part.start or not support.can_cut:
                    break
                plan.append(Segment(part.child, part.start, end, is_async, support.mode, True))
                break  # shorter than planned: the rest is recomputed
            plan.append(
                Segment(part.child, part.start, part.end, is_async, support.mode, support.can_cut)
            )
        return tuple(plan) if plan else RECOMPUTE

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
        if repeat and self.costs is not None:
            self.costs.forget(req_id)
        timed_out, excluded = deadline_and_exclusions(record, self.lookup_timeout_s)
        candidates = self.fixed_candidates or self.policy.candidates(request)
        trace: list[str] | None = [] if self.debug else None
        timeouts: list[int] = []
        found = self.plan(request, local, candidates, excluded, timed_out, trace, timeouts)
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
        counted = not (repeat and same_decision(record, found, local))  # type: ignore[arg-type]
        if counted:
            self.counters.lookups += 1
        else:
            self.counters.inc("lookup_repeats")
        tokens, is_async = self._record(req_id, found, reason, local, record, counted=counted)
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

    def _record(
        self,
        req_id: str,
        found: Plan,
        reason: str,
        local: int,
        record: LoadRecord | None,
        *,
        counted: bool = True,
    ) -> tuple[int, bool]:
        """The decided plan counted (unless it repeats the last one: ``decide``), its loads
        expected (``fastest``) and recorded in the ledger (a plain miss of a request without
        a record needs none); vLLM's answer."""
        if counted:
            for segment in found:
                self.counters.hit(segment.child, segment.tokens)
            if self.costs is not None and (found or found is RECOMPUTE):
                self.counters.inc(fastest.PLAN_COUNTERS[min(len(found), 2)])
        if self.costs is not None:
            self._expect(req_id, found)
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

    def _expect(self, req_id: str, plan: Plan) -> None:
        """``fastest``: each segment's load awaits its time from the worker half."""
        costs = self.costs
        assert costs is not None
        costs.forget(req_id)
        for s in plan:
            predicted = costs.loads[s.child].predict(s.tokens)
            costs.expect(req_id, s.child, s.tokens, predicted, s.is_async)

    # ------------------------------------------------------------ what vLLM calls
    def answer(self, request: Request, num_computed_tokens: int) -> Answer:
        """``get_num_new_matched_tokens``: the common case answered here by the same rule
        (``takes``, the guard's checks, ``leave_one_token``), everything else by ``decide``."""
        asks = self._fast_asks
        if asks is None or request.request_id in self._ledger_ids:
            return self.decide(request, num_computed_tokens, self.ledger.get(request.request_id))
        owner = -1
        tokens = 0
        is_async = False
        pending = False
        checked_misses = self._checked_misses
        for child, ask in asks:
            try:
                result = ask(request, num_computed_tokens)
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
                    if self.longest:
                        continue
                    break
            elif n == 0 and a is False:
                checked_misses[child] = result  # a child answers its miss constant
                continue
            if n <= 0:
                continue
            if not a and num_computed_tokens + n >= request.num_tokens:
                n = self._leave_one(child, request, num_computed_tokens, n)
            if self.takes(tokens, n):
                owner, tokens, is_async = child, n, a
                if self.stop_at_hit:
                    break
        if pending:
            self.ledger.mark_pending(request.request_id, time.monotonic())
            return None, False
        self.counters.lookups += 1
        if owner < 0:
            return MISS  # a plain miss needs no record
        self.ledger.decide(
            request.request_id,
            owner,
            tokens,
            is_async,
            self.fixed_candidates.reason,  # type: ignore[union-attr]
            num_computed_tokens,
        )
        self.counters.hit(owner, tokens)
        return tokens, is_async

    def _answer_fastest(self, request: Request, local: int) -> Answer:
        """``answer`` for ``fastest`` (it replaces ``answer`` on the instance). Its common
        case (as ``answer``'s: no record, no debug trace, no child out of lookups): every
        child asked at ``local`` with ``answer``'s checks, the hits kept as ``plan`` keeps
        them, the cheapest plan (without the list of every plan weighed, which only the debug
        trace shows) realised and recorded as ``decide`` does.
        ``tests/composite/test_hot_paths.py`` checks it against ``decide``."""
        asks = self._fast_asks
        if asks is None or request.request_id in self._ledger_ids:
            return self.decide(request, local, self.ledger.get(request.request_id))
        num_tokens = request.num_tokens
        hits: list[tuple[int, int, bool]] = []
        longest = 0  # where the longest hit ends, and whether any is async (``Planner.scan``)
        any_async = False
        pending = False
        checked_misses = self._checked_misses
        for child, ask in asks:
            try:
                result = ask(request, local)
            except Exception as exc:
                self.guard.child_error(child, "get_num_new_matched_tokens", exc)
                continue  # a miss
            if result is checked_misses[child]:
                continue
            try:
                n, a = result
            except Exception:
                n = a = None
            if type(n) is not int or (n <= 0 and a) or type(result) is not tuple:
                n, a = self.guard.normalise_lookup(child, result)
                if n is None:
                    pending = True  # the others are still asked, as ``plan`` asks them
                    continue
            elif n == 0 and a is False:
                checked_misses[child] = result
                continue
            if n <= 0:
                continue
            if not a and local + n >= num_tokens:
                n = self._leave_one(child, request, local, n)
                if n <= 0:
                    continue
            end = local + n
            hits.append((child, end, a))  # a ``fastest.Hit``'s fields, made faster
            if end > longest:
                longest = end
            if a:
                any_async = True
        req_id = request.request_id
        if pending:
            self.ledger.mark_pending(req_id, time.monotonic())
            return None, False
        self.counters.lookups += 1
        costs = self.costs
        assert costs is not None
        # (no ``costs.forget`` as ``_record`` does: a request without a record, which is all
        # this path sees, has no load awaiting its time; those are given out with a record,
        # which is kept until the request finishes)
        if not hits:
            return MISS
        planner = self.planner
        assert planner is not None
        reason = self.fixed_candidates.reason  # type: ignore[union-attr]
        found = None
        if costs.warm_for_good and not any_async:
            # what ``choose`` would do, without its checks, its objects and ``_realise``: a
            # first-level plan starts at ``local``, so none of its children is asked again
            # (one warm sync hit too: the scan prices it as ``choose``'s ``_one`` does)
            recompute_s = (num_tokens - local) / costs.prefill_tokens_per_s
            found = planner.scan(hits, local, num_tokens, costs, recompute_s, longest)  # type: ignore[arg-type]
        if found is not None:
            child, end, _, load_s = found
            if child < 0:
                self.counters.inc(_PLAN_RECOMPUTE)
                return MISS
            # one child's sync load from ``local``: what ``_realise`` and ``_record`` do,
            # without a segment object (the ledger keeps only its owner), its plan and hit
            # counted in one call (this runs for every request that has hits)
            tokens = end - local
            self.counters.plan_hit(_PLAN_LOAD, child, tokens)
            costs.expect(req_id, child, tokens, load_s, False)
            self.ledger.decide(req_id, child, tokens, False, reason, local)
            return tokens, False
        choice = planner.choose(req_id, hits, local, num_tokens, costs)  # type: ignore[arg-type]
        if len(choice.parts) != 1:
            plan = self._realise(request, local, choice)
            return self._record(req_id, plan, reason, local, None)
        child, _, end, is_async = choice.parts[0]
        # one child loads from ``local``, as above
        tokens = end - local
        self.counters.plan_hit(_PLAN_LOAD, child, tokens)
        costs.expect(req_id, child, tokens, costs.loads[child].predict(tokens), is_async)
        self.ledger.decide(req_id, child, tokens, is_async, reason, local)
        return tokens, is_async
