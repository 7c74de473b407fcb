"""The contract guard on every parent→child edge.

It does three things, and nothing else:

- **normalises** what a child returns where vLLM's contract is strict: ``(0, True)`` from
  ``get_num_new_matched_tokens`` becomes ``(0, False)`` (vLLM's scheduler asserts a positive
  count for async loads), a negative count becomes 0. The owner's positive count is never
  changed (LMCache asserts it receives exactly what it promised) but in the one case vLLM
  cannot take: a sync hit that leaves no token to compute is cut back (``leave_one_token``);
- **counts** every contract violation per child and kind, and logs each kind once per child;
  in ``strict`` mode (for connector authors' tests) it raises ``ContractViolation`` instead;
- **contains errors** according to the child's ``on_error`` policy: ``miss`` (the default)
  lets the caller fall back (a lookup error is a miss for that request; see
  ``docs/concepts.md`` for every method) and logs it once per child and error type; ``fail``
  re-raises, with a note naming the node, the child and the method, and every node above lets
  it through too (whatever its own policy). A child whose lookups raise ``MAX_LOOKUP_ERRORS``
  times is taken out of lookups for new requests (it still hears allocations and finishes),
  with a log line;
- **ejects outliers**: a child with an ``eject`` rule is skipped in lookups for a back-off
  window after its rule's failed calls in a row (errors, slow lookups, lookup deadlines), then
  asked again, instead of being taken out for good (``kvcompose.composite.outliers``). The
  lookup reads both through ``disabled``, and asks the children through ``watch_lookups``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvcompose.composite.outliers import OutOfLookups
from kvcompose.tree.ejection import EjectRule

logger = logging.getLogger("kvcompose")


#: Lookup errors after which a child is no longer asked to look requests up.
MAX_LOOKUP_ERRORS = 5


#: Set on an exception a child raised under ``on_error: fail`` (or strict mode): every node
#: above lets it through to vLLM, whatever its own edge's policy (a node that re-raised left
#: its own call half done: containing it higher up would leave that node's tables corrupt).
_FAILING = "_kvcompose_fail"


def _failing(exc: BaseException) -> bool:
    return getattr(exc, _FAILING, False)


class ContractViolation(AssertionError):
    """A child broke the vLLM connector contract (raised in strict mode only)."""


class Guard:
    """Violation and error bookkeeping for one composite node's children."""

    def __init__(
        self,
        node_name: str,
        child_names: list[str],
        *,
        strict: bool,
        on_error: list[str],
        count: Callable[[str], None] | None = None,
        eject: list[EjectRule | None] | None = None,
    ) -> None:
        self.node_name = node_name
        self._count = count or (lambda key: None)
        self.child_names = child_names
        self.strict = strict
        self.on_error = on_error
        self.violations: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[str, str]] = Counter()
        self.lookup_errors: Counter[int] = Counter()
        #: Called after a child is taken out of lookups or let back in (the scheduler half
        #: answers lookups on its fast path, which asks every candidate, only while none is).
        self.on_disable: list[Callable[[], None]] = []
        #: The children lookups skip now: out for good, or ejected by their rule.
        self.disabled = OutOfLookups(
            node_name,
            child_names,
            eject or [None] * len(child_names),
            self._count,
            self._out_changed,
        )

    def _out_changed(self) -> None:
        for hook in self.on_disable:
            hook()

    # ------------------------------------------------------------- ejection
    def watch_lookups(self, lookups: list[Callable[..., Any]]) -> list[Callable[..., Any]]:
        """The children's ``get_num_new_matched_tokens``, each child with an ``eject`` rule's
        timed against it (``OutOfLookups.watch``); the others unchanged."""
        return [self.disabled.watch(i, ask) for i, ask in enumerate(lookups)]

    def lookup_timed_out(self, child: int) -> None:
        """A child still answered "still looking" at the node's lookup deadline."""
        self.disabled.failed(child, "still looking at the lookup deadline")

    # ------------------------------------------------------------ violations
    def violation(self, child: int, kind: str, detail: str) -> None:
        name = self.child_names[child] if child >= 0 else self.node_name
        key = (name, kind)
        first = key not in self.violations
        self.violations[key] += 1
        self._count(f"violations.{name}.{kind}")
        message = (
            f"kvcompose[{self.node_name}]: child {name!r} broke the contract ({kind}): {detail}"
        )
        if self.strict:
            raise ContractViolation(message)
        if first:
            logger.warning("%s (logged once per child and kind)", message)

    def fenced(self, child: int, detail: str) -> None:
        """A child's late report for a load the worker half already failed for its raise:
        dropped and counted, not a violation (the child cannot know the load was given up)."""
        name = self.child_names[child]
        self._count(f"fenced.{name}")
        logger.debug("kvcompose[%s]: dropped child %r's %s", self.node_name, name, detail)

    def normalise_lookup(self, child: int, result: Any) -> tuple[int | None, bool]:
        """Check a child's ``get_num_new_matched_tokens`` answer."""
        if type(result) is tuple and len(result) == 2 and type(result[0]) is int:
            tokens, is_async = result  # the common, well-formed answers, checked cheaply
            if tokens > 0:
                return tokens, bool(is_async)
            if tokens == 0 and not is_async:
                return 0, False
        return self._normalise_slow(child, result)

    def _normalise_slow(self, child: int, result: Any) -> tuple[int | None, bool]:
        if not (isinstance(result, tuple) and len(result) == 2):
            self.violation(child, "lookup_shape", f"returned {result!r}, not (int | None, bool)")
            return 0, False
        tokens, is_async = result
        if tokens is None:
            return None, bool(is_async)
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            self.violation(
                child, "lookup_type", f"returned a count of type {type(tokens).__name__}"
            )
            return 0, False
        if tokens < 0:
            self.violation(child, "negative_tokens", f"returned {tokens} tokens")
            return 0, False
        if tokens == 0 and is_async:
            self.violation(child, "zero_async", "returned (0, True); normalised to (0, False)")
            return 0, False
        return tokens, bool(is_async)

    def leave_one_token(self, child: int, at: int, tokens: int, num_tokens: int, cut: int) -> int:
        """A sync hit of ``tokens`` at ``at`` that leaves nothing of a ``num_tokens`` request
        to compute: vLLM's scheduler asserts a sync load leaves at least one token to schedule
        (``Scheduler.schedule``), so the answer is cut to ``cut`` (the caller's, on a block
        boundary where the child's range mode needs one), counted and logged once per child."""
        self.violation(
            child,
            "whole_prompt_sync",
            f"answered {tokens} sync tokens at {at} of a {num_tokens}-token request, "
            f"leaving vLLM nothing to compute; cut to {cut}",
        )
        return cut

    # ---------------------------------------------------------------- errors
    def child_error(self, child: int, where: str, exc: BaseException) -> None:
        """A child raised in ``where``. Re-raises under ``on_error: fail``."""
        name = self.child_names[child]
        key = (name, f"{where}:{type(exc).__name__}")
        first = key not in self.errors
        self.errors[key] += 1
        self._count(f"errors.{name}.{where}")
        if self.on_error[child] == "fail" or self.strict or _failing(exc):
            if not _failing(exc):
                policy = "fail" if self.on_error[child] == "fail" else "strict"
                exc.add_note(
                    f"kvcompose[{self.node_name}]: child {name!r} raised in {where} "
                    f"(on_error: {policy}: the error goes through to vLLM)"
                )
                setattr(exc, _FAILING, True)
            raise exc
        if self.disabled.rules[child] is not None:
            # under an ejection rule, any failed call counts; the rule takes the child out
            self.disabled.failed(child, f"{type(exc).__name__} in {where}")
        elif where == "get_num_new_matched_tokens":
            self.lookup_errors[child] += 1
            if (
                self.lookup_errors[child] >= MAX_LOOKUP_ERRORS
                and child not in self.disabled.for_good
            ):
                self.disabled.add(child)
                self._out_changed()
                logger.error(
                    "kvcompose[%s]: child %r failed %d lookups; it is no longer asked "
                    "to look up new requests",
                    self.node_name,
                    name,
                    self.lookup_errors[child],
                )
        if first:
            logger.error(
                "kvcompose[%s]: child %r raised %s in %s; treated as a miss "
                "(logged once per child and error type)",
                self.node_name,
                name,
                type(exc).__name__,
                where,
                exc_info=exc,
            )
