"""The children a node's lookups skip now: taken out for good, or ejected for a while.

A child is taken out *for good* after repeated lookup errors when it has no ejection rule
(``kvcompose.composite.guard``). A child with a rule (``eject`` in the config,
``kvcompose.tree.ejection.EjectRule``) is *ejected* instead, as service meshes eject an
outlier host: after ``failures`` failed calls in a row (a raise, a lookup slower than
``slow_ms``, "still looking" at the node's lookup deadline) it is skipped for a back-off window,
then asked once again (the trial). An answer in time puts it back; a failure ejects it again
for twice as long, up to ``max_backoff_s``.

An ejected child still hears every allocation and finish (vLLM's contract: every child is told
about every allocation), it is only not asked to look up. Why this bounds an outage: vLLM's
scheduler calls ``get_num_new_matched_tokens`` inside ``Scheduler.schedule``, so a child whose
lookup waits on a dead server holds the whole engine step, every request's, for as long as
its client waits.

``OutOfLookups`` is set-like, so the lookup asks ``child in out`` before each child (and the
guard keeps it as ``Guard.disabled``, the name the lookup reads). A ``True`` answer during a
back-off is counted as ``ejected_lookups.<child>``; the first ``in`` after the back-off ends
starts the trial and answers ``False``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvcompose.tree.ejection import EjectRule

logger = logging.getLogger("kvcompose")


@dataclass
class _Ejection:
    """One child's standing under its rule."""

    failures: int = 0  # failed calls in a row
    ejections: int = 0  # ejections in a row (the back-off doubles with each)
    until: float | None = None  # ejected until then (monotonic seconds)
    trial_since: float | None = None  # back on trial since then (not answered yet)


def answered(result: Any) -> bool:
    """Whether a lookup's result is an answer (not ``(None, ...)``, "still looking")."""
    return not (isinstance(result, tuple) and len(result) == 2 and result[0] is None)


class OutOfLookups:
    """The children of one node that its lookups skip now (see the module docstring)."""

    def __init__(
        self,
        node_name: str,
        child_names: Sequence[str],
        rules: Sequence[EjectRule | None],
        count: Callable[[str], None],
        changed: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_name = node_name
        self.child_names = child_names
        self.rules = list(rules)
        self._count = count
        self._changed = changed
        #: the clock back-offs and lookup times are read from (tests replace it)
        self.clock = clock
        self.for_good: set[int] = set()
        self.states = {i: _Ejection() for i, rule in enumerate(self.rules) if rule is not None}

    # --------------------------------------------------------------- the set view
    def add(self, child: int) -> None:
        """Take ``child`` out of lookups for good."""
        self.for_good.add(child)

    def __contains__(self, child: object) -> bool:
        if child in self.for_good:
            return True
        state = self.states.get(child)  # type: ignore[call-overload]
        if state is None or state.until is None:
            return False
        now = self.clock()
        if now < state.until:
            self._count(f"ejected_lookups.{self.child_names[child]}")  # type: ignore[index]
            return True
        state.until, state.trial_since = None, now  # the back-off is over: one trial
        logger.info(
            "kvcompose[%s]: child %r's back-off is over; asking it again",
            self.node_name,
            self.child_names[child],  # type: ignore[index]
        )
        return False

    def __bool__(self) -> bool:
        """Whether any child is out or on trial (the lookup's fast path is off then)."""
        return bool(self.for_good) or any(
            s.until is not None or s.trial_since is not None for s in self.states.values()
        )

    def __iter__(self) -> Iterator[int]:
        """The children out now (for good, or ejected and in their back-off)."""
        now = self.clock()
        out = set(self.for_good)
        out.update(i for i, s in self.states.items() if s.until is not None and now < s.until)
        return iter(sorted(out))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def ejected(self, child: int) -> bool:
        """Whether ``child`` is ejected now (without counting a skipped lookup)."""
        state = self.states.get(child)
        return state is not None and state.until is not None and self.clock() < state.until

    # ----------------------------------------------------------------- verdicts
    def watch(self, child: int, ask: Callable[..., Any]) -> Callable[..., Any]:
        """``ask`` (the child's ``get_num_new_matched_tokens``) timed against its rule; the
        same function for a child without one. A raise goes through (the lookup hands it to
        ``Guard.child_error``, which calls ``failed``)."""
        rule = self.rules[child]
        if rule is None:
            return ask
        slow_s = rule.slow_ms / 1000.0
        name = self.child_names[child]

        def watched(request: Any, num_computed_tokens: int) -> Any:
            clock = self.clock
            start = clock()
            result = ask(request, num_computed_tokens)
            took = clock() - start
            if took > slow_s:
                self._count(f"slow_lookups.{name}")
                self.failed(child, f"a lookup took {took * 1000:.0f} ms")
            elif answered(result):
                self.succeeded(child)
            else:
                self.still_looking(child, slow_s)
            return result

        return watched

    def succeeded(self, child: int) -> None:
        state = self.states[child]
        state.failures = 0
        if state.trial_since is not None:
            state.trial_since, state.ejections = None, 0
            self._count(f"readmissions.{self.child_names[child]}")
            logger.warning(
                "kvcompose[%s]: child %r answered in time; it is asked again",
                self.node_name,
                self.child_names[child],
            )
            self._changed()

    def still_looking(self, child: int, slow_s: float) -> None:
        """A "still looking" answer: no verdict, unless it is the trial's, late."""
        state = self.states[child]
        if state.trial_since is not None and self.clock() - state.trial_since > slow_s:
            self.failed(child, "its trial lookup found nothing in time")

    def failed(self, child: int, why: str) -> None:
        """A failed call of ``child``: ejects it after its rule's ``failures`` in a row, or at
        once on trial. Nothing for a child without a rule, or one already ejected."""
        state = self.states.get(child)
        if state is None or state.until is not None:
            return
        rule = self.rules[child]
        assert rule is not None
        state.failures += 1
        if state.trial_since is None and state.failures < rule.failures:
            return
        state.ejections += 1
        backoff = rule.backoff(state.ejections)
        state.until = self.clock() + backoff
        state.trial_since, state.failures = None, 0
        self._count(f"ejections.{self.child_names[child]}")
        logger.warning(
            "kvcompose[%s]: child %r ejected from lookups for %g s (%s; ejection %d in a row)",
            self.node_name,
            self.child_names[child],
            backoff,
            why,
            state.ejections,
        )
        self._changed()
