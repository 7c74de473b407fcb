"""Fences: a child's late reports for loads the worker half already failed for its raise.

A child that raises while loading has its loads failed (``kvcompose.composite.worker``), but
its transfers may go on. Once vLLM has heard that a load failed, it frees the request's blocks
(or cuts it back) and hands them to other requests, so the child's late reports for that load
are dropped: its receive, and bad block ids it names inside the failed load's blocks (they
would name another request's blocks by then), also while another child owns the request's
next load. Per child and request::

                 the child raised: its load failed
    (none) ─────────────────────────────────────────▶ FENCED (the load's blocks)
                                                        │  a new load of the same child
                                                        │  lifts the fence on its blocks
                                                        ▼
                     after the step of the child's first receive for the request,
    (none) ◀──────── or once vLLM frees the request's blocks (it finished and no
                     child's send holds them), whichever comes first

If the request's new load is the same child's, its first receive goes up as the new load's: a
child reports by request id, so the two cannot be told apart (a node excludes the failed child
from the request's next lookup, so this is the rarer case). A finished request leaves nothing
behind: a child's receive for a request the node no longer knows, once that child has had a
fence, is taken as a late report of a fence that ended with the free (the node remembers which
children raised, not which requests). On several KV cache groups, where no block id may go
up, bad blocks that no load claims are such a late report too when they come with a dropped
late receive, or when the child loads nothing: they fail none of its other loads (on one
group they go up, marking freed blocks invalid at worst). Fenced reports are counted as
``fenced.<child>``, not as violations: the child cannot know the load was given up.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcompose.composite.guard import Guard


class Fences:
    """The fenced loads of one node's worker half: child -> request -> the load's blocks."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._fences: dict[int, dict[str, frozenset[int]]] = {}
        self._ending: list[tuple[int, str]] = []
        self._fenced_children: set[int] = set()  # every child that ever had a fence
        self._late: set[int] = set()  # children whose late receive was dropped this step

    def __bool__(self) -> bool:
        return bool(self._fenced_children)

    def fence(self, child: int, req_id: str, blocks: Iterable[int]) -> None:
        self._fences.setdefault(child, {})[req_id] = frozenset(blocks)
        self._fenced_children.add(child)

    def lift(self, loads: Iterable[tuple[int, Iterable[int]]]) -> None:
        """A child's new loads lift its fences on their blocks: errors there are the new
        load's. An emptied fence stays: the failed load's late receive is still dropped."""
        for child, blocks in loads:
            fences = self._fences.get(child)
            if fences:
                for req_id, fenced in list(fences.items()):
                    fences[req_id] = fenced.difference(blocks)

    def receive(self, child: int, req_id: str, owner: int | None) -> bool:
        """``child`` reports a receive for ``req_id``: True if it is a fenced load's late
        receive, dropped (counted). The fence ends after this step; the receive is the
        failed load's unless the child owns the request's new load."""
        if req_id not in self._fences.get(child, ()):
            if owner is None and child in self._fenced_children:
                self._guard.fenced(child, f"receive of {req_id}, freed since its load failed")
                self._late.add(child)
                return True
            return False
        self._ending.append((child, req_id))
        if owner == child:
            return False
        self._guard.fenced(child, f"receive of {req_id}'s failed load")
        self._late.add(child)
        return True

    def drop(self, child: int, blocks: set[int]) -> set[int]:
        """``child``'s bad blocks less those inside its fenced loads (dropped, counted)."""
        fences = self._fences.get(child)
        if not fences:
            return blocks
        fenced = blocks.intersection(set().union(*fences.values()))
        if not fenced:
            return blocks
        self._guard.fenced(child, f"bad blocks {sorted(fenced)} of a failed load")
        return blocks - fenced

    def late_report(self, child: int, what: str, *, loading: bool) -> bool:
        """``child`` names bad blocks no load of it claims (several KV cache groups, where
        they cannot go up): True, dropped and counted, if they are a failed load's late
        report: the child's late receive was dropped this step (a child reports a load's
        bad blocks with its receive), or, ``loading`` nothing, it ever had a fence (whose
        load vLLM freed since: the node remembers which children raised, not which
        requests, as for a late receive)."""
        if child not in self._late and (loading or child not in self._fenced_children):
            return False
        self._guard.fenced(child, what)
        return True

    def end_step(self) -> None:
        """After the step's errors were taken: fences whose late receive came this step end."""
        for child, req_id in self._ending:
            self._end(child, req_id)
        self._ending.clear()
        self._late.clear()

    def end_freed(self, req_ids: Iterable[str]) -> None:
        """vLLM freed these requests' blocks: their fences end, so a finished request leaves
        nothing behind. A late bad-block report naming those blocks after this marks another
        request's blocks invalid at worst: a needless recompute, never garbage."""
        for child in list(self._fences):
            for req_id in req_ids:
                self._end(child, req_id)

    def _end(self, child: int, req_id: str) -> None:
        fences = self._fences.get(child)
        if fences is not None:
            fences.pop(req_id, None)
            if not fences:
                del self._fences[child]

    def live(self) -> dict[int, list[str]]:
        return {child: sorted(fences) for child, fences in self._fences.items()}
