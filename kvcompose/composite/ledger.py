"""The per-request load state machine of one composite node (scheduler side).

**Loads** (``Ledger``): one ``LoadRecord`` per request the node has been asked about, from the
first lookup until ``request_finished``. The record answers the questions the rest of the node
needs: *who owns the load*, *how many tokens it promised*, *is it async*, *which children have
already failed this request*.

State machine (transitions are the only methods that change a record)::

                 lookup → None                lookup → decided
    (absent) ─────────────────▶ PENDING ───────────────────────▶ OWNED
        │                          ▲                               │ alloc(n)
        │ lookup → decided         │ re-lookup (scheduler reset:   ├─ n == 0 ──────────▶ NO_LOAD
        └──────────────────────────┼─ preemption, failed load, ────┤─ n > 0, sync ─────▶ LOADED
                                   │  allocation retry)            └─ n > 0, async ──▶ LOADING
                                   │                                                    │
                 NO_LOAD / LOADED / FAILED / OWNED ◀── finished_recving ──▶ LOADED ◀─────┤
                                                      failed_recving ──▶ FAILED ◀───────┘
    any state ── request_finished ──▶ (removed; a ``finishes.FinishRecord`` may take over)

A lookup that finds no owner for a request the node holds no record of creates none: a plain
miss leaves nothing to track (the allocation that follows tells every child 0 tokens).

A **stitched** load (``policy: stitch`` with two or more loading children) has no single owner
(``owner`` is None) but ``segments`` (``kvcompose.composite.segments``), loaded in rounds that
each end with one receive (the worker sends one for all of a round's async segments; a round
of sync segments only ends with the worker's own)::

                 alloc(n > 0)             the round's receive
    OWNED ─────────────────────▶ LOADING ───┬─ no segment failed ─▶ LOADED, or FAILED when
                                    ▲        │                       part of the grant is lost
                                    │        └─ a segment failed ──▶ RECOVERING
                                    │                                     │
                                    └──── recovery (next step): reload ───┘
                                          the gaps, or give them up

A segment's failure reaches the scheduler half through the worker's metadata
(``segments_failed``; vLLM has already read the step's failures when the node sees it), and
the worker hides it from vLLM: the receive that ends a round with a failed segment is taken
out of the step's output (the request stays parked) and the record waits in ``RECOVERING``
for the scheduler half to plan the next round
(``kvcompose.composite.stitch.StitchPlanner.recover``): other
children reload the failed ranges, and what none can reload is given up at the next receive
(invalid blocks from ``lost_from`` on, or ``failed_recving`` on several KV cache groups).
The grant re-cuts the segments at allocation; a segment that cannot be cut is dropped and its
part of the grant given up the same way (``lost_from``).

An owned load whose owner is a nested stitched node that holds its receive back for a
recovery round goes back from ``LOADED`` to ``LOADING`` (``receive_held``): the owner's next
receive ends it.

A **parked** sync load: on a model with several KV cache groups vLLM takes no invalid block
ids (``Scheduler._handle_invalid_blocks`` raises) and has no request-level failure signal for
a sync load, so a decided sync load whose children can all be parked (``PARKABLE_MODES``: a
child that loads what its metadata names whether vLLM schedules the request or not) is
reported to vLLM as async (``park``): an owned one becomes a stitched load of one segment,
``is_async`` is set, and it goes the stitched way: vLLM holds the request for the step the
children load in, the worker half reports the round's receive itself, and a failed segment is
recovered or given up by request (``failed_recving``). A sync hit that cannot be parked is
never planned (the lookup skips it, ``park_only``), so every sync plan there can be parked.

A second ``update_state_after_alloc(…, 0)`` after an async load leaves the state unchanged.
A failed owner is remembered in ``excluded`` and skipped when the scheduler looks the request
up again (``kv_load_failure_policy="recompute"`` after a total failure), so the next child can
serve it. A nested node is never excluded for a failed load (``nested``): its own ledger
excludes the child of its that failed, so asked again it falls back to its next child.

**After the finish**: a finished request's completion signals are the job of
``kvcompose.composite.finishes``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, KeysView, Sequence
from dataclasses import dataclass
from typing import Any

from kvcompose.composite import segments as seg
from kvcompose.composite.segments import Segment, SegmentError

#: Range modes (``kvcompose.tree.ranges``) of children that load what their metadata names
#: whether vLLM schedules the request in that step or holds it parked: their sync loads can be
#: reported to vLLM as async (``Ledger.park``), as stitched rounds already hold them.
PARKABLE_MODES = frozenset({"native", "last_segment"})


class LoadState(enum.Enum):
    PENDING = "pending"
    OWNED = "owned"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    NO_LOAD = "no_load"
    RECOVERING = "recovering"  # a stitched load's round ended with a failed segment


#: States from which the scheduler may legitimately ask for a fresh lookup.
_RELOOKUP_FROM = frozenset(
    {LoadState.PENDING, LoadState.OWNED, LoadState.NO_LOAD, LoadState.LOADED, LoadState.FAILED}
)


_ALLOCATED = frozenset({LoadState.LOADING, LoadState.LOADED})
#: Looked up and not allocated since: the lookup deadline's clock runs.
UNALLOCATED = frozenset({LoadState.PENDING, LoadState.OWNED})


class LedgerError(RuntimeError):
    """An event arrived that the state machine does not allow (a vLLM or child bug)."""


@dataclass(slots=True)
class LoadRecord:
    state: LoadState
    owner: int | None = None
    tokens: int = 0
    is_async: bool = False
    local_tokens: int = 0  # the local prefix hit the lookup was shown; the load starts there
    load_blocks: tuple[int, ...] = ()  # the blocks the owner's load writes (group 0)
    reason: str = ""
    pending_since: float | None = None
    excluded: frozenset[int] = frozenset()  # children whose load of this request failed
    segments: tuple[Segment, ...] = ()  # a stitched load's ranges (no single owner)
    # a stitched load, from its allocation: the children whose async segments the round's
    # receive is for, the first token no segment will deliver (vLLM recomputes from its
    # block), the end of the grant, and what a recovery hands a child (vLLM's Request and
    # KVCacheBlocks)
    awaiting: tuple[int, ...] = ()
    lost_from: int | None = None
    load_end: int = 0
    request: Any = None
    blocks: Any = None

    @property
    def stitched(self) -> bool:
        return bool(self.segments)

    def loaders(self) -> tuple[int, ...]:
        """The children that load (or loaded) this request: the owner, or every active
        segment's child."""
        if self.segments:
            return tuple(s.child for s in self.segments if s.active)
        return () if self.owner is None else (self.owner,)

    def receivers(self) -> tuple[int, ...]:
        """The children a receive of this request belongs to: the owner, or the children
        of a stitched load's async segments of the current round (the worker sends one
        receive for all of them)."""
        if self.segments:
            return self.awaiting
        return () if self.owner is None else (self.owner,)

    def as_dict(self, names: list[str] | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "state": self.state.value,
            "owner": self.owner,
            "tokens": self.tokens,
            "async": self.is_async,
            "reason": self.reason,
            "excluded": sorted(self.excluded),
        }
        if self.segments:
            out["segments"] = [s.as_dict(names) for s in self.segments]
        if self.lost_from is not None:
            out["lost_from"] = self.lost_from
        return out


class Ledger:
    """Ownership records of one node, keyed by request id."""

    def __init__(self, nested: frozenset[int] = frozenset()) -> None:
        self._records: dict[str, LoadRecord] = {}
        #: Children that are composite nodes: they exclude their own failed children.
        self.nested = nested
        #: The record of a request (None if unknown); the dict's own ``get``: the scheduler
        #: half asks for every waiting request every step.
        self.get: Callable[[str], LoadRecord | None] = self._records.get
        #: The ids of the requests with a record (a live view).
        self.ids: KeysView[str] = self._records.keys()

    def owner(self, req_id: str) -> int | None:
        record = self._records.get(req_id)
        return None if record is None else record.owner

    def __len__(self) -> int:
        return len(self._records)

    def snapshot(self, names: list[str] | None = None) -> dict[str, dict[str, object]]:
        return {req_id: rec.as_dict(names) for req_id, rec in self._records.items()}

    # ------------------------------------------------------------- transitions
    def _for_lookup(self, req_id: str) -> LoadRecord:
        record = self._records.get(req_id)
        if record is None:
            record = self._records[req_id] = LoadRecord(LoadState.PENDING)
        elif record.state not in _RELOOKUP_FROM:
            raise LedgerError(
                f"request {req_id}: lookup while {record.state.value} "
                f"(owner {record.owner}); vLLM only looks up reset requests"
            )
        return record

    def mark_pending(self, req_id: str, now: float) -> None:
        """A lookup could not decide yet (children answered ``None``). The deadline clock
        starts at the first such answer since the request was last allocated: a request vLLM
        asks again before allocating it (``OWNED``) keeps its clock, so a child that missed
        the deadline is not waited for again."""
        record = self._for_lookup(req_id)
        if record.state not in UNALLOCATED or record.pending_since is None:
            record.pending_since = now
        record.state, record.owner, record.tokens = LoadState.PENDING, None, 0

    def decide(
        self,
        req_id: str,
        owner: int | None,
        tokens: int,
        is_async: bool,
        reason: str,
        local_tokens: int,
    ) -> LoadRecord:
        """A lookup decided: ``owner`` (or nobody) loads ``tokens`` after ``local_tokens``.
        A re-lookup (after preemption or a failed load) keeps ``excluded``."""
        record = self._for_lookup(req_id)
        record.state, record.owner, record.tokens = LoadState.OWNED, owner, tokens
        record.is_async, record.reason, record.local_tokens = is_async, reason, local_tokens
        record.load_blocks, record.segments = (), ()  # (``pending_since`` runs on: above)
        record.awaiting, record.lost_from, record.request, record.blocks = (), None, None, None
        return record

    def decide_stitch(
        self, req_id: str, segments: tuple[Segment, ...], reason: str, local_tokens: int
    ) -> LoadRecord:
        """A stitch lookup decided: ``segments`` (two or more) load after ``local_tokens``."""
        tokens = sum(s.tokens for s in segments)
        is_async = any(s.is_async for s in segments)
        record = self.decide(req_id, None, tokens, is_async, reason, local_tokens)
        record.segments = segments
        return record

    def park(self, record: LoadRecord, supports: Sequence[Any]) -> bool:
        """A decided sync load (``OWNED``) told to vLLM as async, if every loading child's
        range mode (``supports[child].mode``) is in ``PARKABLE_MODES``: an owned load becomes
        one segment ``[local, local + tokens)``. Returns False (nothing changed) otherwise."""
        if record.state is not LoadState.OWNED or record.is_async or record.tokens <= 0:
            return False
        if record.segments:
            if any(supports[s.child].mode not in PARKABLE_MODES for s in record.segments):
                return False
        else:
            if record.owner is None:
                return False
            support = supports[record.owner]
            if support.mode not in PARKABLE_MODES:
                return False
            start = record.local_tokens
            record.segments = (
                Segment(
                    record.owner,
                    start,
                    start + record.tokens,
                    False,
                    support.mode,
                    support.can_cut,
                ),
            )
            record.owner = None
        record.is_async = True
        return True

    def allocated(self, req_id: str, num_external_tokens: int) -> LoadRecord | None:
        """``update_state_after_alloc`` was called. Returns the record (None if unknown)."""
        record = self._records.get(req_id)
        if record is None:
            if num_external_tokens > 0:
                raise LedgerError(
                    f"request {req_id}: {num_external_tokens} external tokens "
                    "allocated but this node was never asked to look it up"
                )
            return None
        if record.state is not LoadState.OWNED:
            if num_external_tokens == 0 and record.state in _ALLOCATED:
                return record  # the second call after an async load, or a later allocation
            if num_external_tokens > 0:
                raise LedgerError(
                    f"request {req_id}: {num_external_tokens} tokens allocated "
                    f"while {record.state.value}"
                )
            return record
        if num_external_tokens > record.tokens:
            raise LedgerError(
                f"request {req_id}: scheduler allocated {num_external_tokens} "
                f"external tokens, more than the {record.tokens} promised"
            )
        if record.segments:
            try:
                lost = seg.grant(record.segments, record.local_tokens, num_external_tokens)
            except SegmentError as exc:
                raise LedgerError(f"request {req_id}: {exc}") from None
            record.load_end = record.local_tokens + num_external_tokens
            if lost is not None:  # an uncuttable segment dropped: skip it on a re-lookup
                record.lost_from = lost
                record.excluded = record.excluded | {
                    s.child for s in record.segments if s.start == lost
                }
            # vLLM parks the request whenever it granted tokens of an async answer, even
            # if the cut left only sync segments: the worker then signals their end itself
        record.pending_since = None  # allocated: a later lookup's deadline starts afresh
        if num_external_tokens == 0:
            record.state = LoadState.NO_LOAD
        elif record.is_async:
            record.state = LoadState.LOADING
        else:
            record.state = LoadState.LOADED
        return record

    def recv_finished(self, req_id: str, failed: bool) -> LoadRecord | None:
        """The request's (one) receive; for a stitched load, the end of a round (its failed
        segments already marked by ``segments_failed``). Returns the record if it tracks a
        load that was in flight."""
        record = self._records.get(req_id)
        if record is None or record.state is not LoadState.LOADING:
            return None  # aborted before the load completed; nothing to track
        if record.segments:
            record.awaiting = ()
            if seg.settle(record.segments):
                record.state = LoadState.RECOVERING
            elif failed or record.lost_from is not None:
                record.state = LoadState.FAILED
            else:
                record.state = LoadState.LOADED
            return record
        if failed:
            record.state = LoadState.FAILED
            if record.owner is not None:
                self._exclude_failed(record, {record.owner})
        else:
            record.state = LoadState.LOADED
        return record

    def segments_failed(self, req_id: str, children: frozenset[int]) -> None:
        """The worker reports that ``children``'s segments of the stitched load's current
        round failed (it may be before the round's receive: with several workers, each
        reports when its own loads end). They are skipped from now on."""
        record = self._records.get(req_id)
        if record is None or record.state is not LoadState.LOADING or not record.segments:
            return  # aborted, or not a stitched load in flight
        for child in children:
            seg.fail(record.segments, child)
        self._exclude_failed(record, children)

    def _exclude_failed(self, record: LoadRecord, children: set[int] | frozenset[int]) -> None:
        """``children``'s loads of ``record`` failed: skip them on a re-lookup, except the
        nested nodes (they skip their own failed child and can still serve it)."""
        record.excluded = record.excluded | (frozenset(children) - self.nested)

    def recovered(self, record: LoadRecord, reloads: tuple[Segment, ...], lost: int | None) -> None:
        """A recovery planned the next round: ``reloads`` load (parts of) the failed ranges,
        and from ``lost`` on (if not None) the load is given up."""
        if record.state is not LoadState.RECOVERING:
            raise LedgerError(f"recovery planned while {record.state.value}")
        for s in record.segments:
            if s.state is seg.SegmentState.FAILED:
                s.state = seg.SegmentState.REPLACED
        record.segments = record.segments + reloads
        record.awaiting = tuple(s.child for s in reloads if s.is_async)
        if lost is not None:
            record.lost_from = lost if record.lost_from is None else min(lost, record.lost_from)
        record.state = LoadState.LOADING

    def receive_held(self, req_id: str, child: int) -> None:
        """The owner ``child`` (a nested stitched node) held the receive back for a recovery
        round: the load is in flight again until its next receive."""
        record = self._records.get(req_id)
        if record is not None and record.owner == child and record.state in _ALLOCATED:
            record.state = LoadState.LOADING

    def exclude_owners_of_blocks(self, block_ids: set[int]) -> None:
        """Loads with blocks reported invalid: their owners are skipped if vLLM looks the
        request up again (it does after a total failure under ``recompute``)."""
        for record in self._records.values():
            if record.owner is not None and block_ids.intersection(record.load_blocks):
                self._exclude_failed(record, {record.owner})
            for segment in record.segments:
                if segment.active and block_ids.intersection(segment.block_ids):
                    self._exclude_failed(record, {segment.child})

    def finished(self, req_id: str) -> LoadRecord | None:
        return self._records.pop(req_id, None)
