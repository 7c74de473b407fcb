"""The per-request state machines of one composite node (scheduler side).

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
    any state ── request_finished ──▶ (removed; a FinishRecord may take over, below)

A lookup that finds no owner for a request the node holds no record of creates none: a plain
miss leaves nothing to track (the allocation that follows tells every child 0 tokens).

A second ``update_state_after_alloc(…, 0)`` after an async load leaves the state unchanged.
A failed owner is remembered in ``excluded`` and skipped when the scheduler looks the request
up again (``kv_load_failure_policy="recompute"`` after a total failure), so the next child can
serve it.

**After the finish** (``Finishes``): a finished request may still expect completion signals:
the receive of an async load that was in flight (an abort while loading; vLLM keeps the blocks
until it arrives) and the send of the children that delayed the free (``request_finished`` →
``True``, or an accepted partial tail). vLLM frees the request on the first terminal signal and
asserts on a second, and a send arriving first would free blocks the owner still loads into.
So when both are expected, the node swallows the receive and holds the send until both
happened; vLLM sees one ``finished_sending``. One ``FinishRecord`` per such request::

                 request_finished
    (absent) ─┬─ load in flight, no delay ──▶ AWAITING_RECV ── recv: passes ──▶ (removed)
              ├─ delayed, no load in flight ─▶ AWAITING_SENDS ── send: passes ─▶ (removed)
              └─ load in flight and delayed ─▶ AWAITING_RECV_AND_SENDS
                                                 │ recv: held               │ send: held
                                                 ▼                          ▼
                                   RECEIVED_AWAITING_SENDS        SENT_AWAITING_RECV
                                                 │ send: passes             │ recv: held, and
                                                 ▼                          ▼ the send goes up
                                             (removed)                  (removed)

A signal a record does not expect (a duplicate) leaves it unchanged: a receive is held while
the send is awaited after a receive, a send is held while the receive is awaited after a
send, anything else passes. The worker half already drops duplicates, so these do not occur
with its filtering.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LoadState(enum.Enum):
    PENDING = "pending"
    OWNED = "owned"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    NO_LOAD = "no_load"


#: States from which the scheduler may legitimately ask for a fresh lookup.
_RELOOKUP_FROM = frozenset(
    {LoadState.PENDING, LoadState.OWNED, LoadState.NO_LOAD, LoadState.LOADED, LoadState.FAILED}
)


_ALLOCATED = frozenset({LoadState.LOADING, LoadState.LOADED})


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

    def as_dict(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "owner": self.owner,
            "tokens": self.tokens,
            "async": self.is_async,
            "reason": self.reason,
            "excluded": sorted(self.excluded),
        }


class Ledger:
    """Ownership records of one node, keyed by request id."""

    def __init__(self) -> None:
        self._records: dict[str, LoadRecord] = {}

    # ------------------------------------------------------------------ queries
    def get(self, req_id: str) -> LoadRecord | None:
        return self._records.get(req_id)

    def owner(self, req_id: str) -> int | None:
        record = self._records.get(req_id)
        return None if record is None else record.owner

    def __len__(self) -> int:
        return len(self._records)

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {req_id: rec.as_dict() for req_id, rec in self._records.items()}

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
        starts at the first such answer since the request was last decided."""
        record = self._for_lookup(req_id)
        if record.state is not LoadState.PENDING or record.pending_since is None:
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
        record.pending_since, record.load_blocks = None, ()
        return record

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
        if num_external_tokens == 0:
            record.state = LoadState.NO_LOAD
        elif record.is_async:
            record.state = LoadState.LOADING
        else:
            record.state = LoadState.LOADED
        return record

    def recv_finished(self, req_id: str, failed: bool) -> None:
        record = self._records.get(req_id)
        if record is None or record.state is not LoadState.LOADING:
            return  # aborted before the load completed; nothing to track
        if failed:
            record.state = LoadState.FAILED
            if record.owner is not None:
                record.excluded = record.excluded | {record.owner}
        else:
            record.state = LoadState.LOADED

    def exclude_owners_of_blocks(self, block_ids: set[int]) -> None:
        """Loads with blocks reported invalid: their owners are skipped if vLLM looks the
        request up again (it does after a total failure under ``recompute``)."""
        for record in self._records.values():
            if record.owner is not None and block_ids.intersection(record.load_blocks):
                record.excluded = record.excluded | {record.owner}

    def finished(self, req_id: str) -> LoadRecord | None:
        return self._records.pop(req_id, None)


class FinishState(enum.Enum):
    AWAITING_RECV = "awaiting_recv"
    AWAITING_SENDS = "awaiting_sends"
    AWAITING_RECV_AND_SENDS = "awaiting_recv_and_sends"
    RECEIVED_AWAITING_SENDS = "received_awaiting_sends"
    SENT_AWAITING_RECV = "sent_awaiting_recv"


class Signal(enum.Enum):
    """What vLLM's scheduler is shown of a completion signal for a finished request."""

    PASS = "pass"  # goes up unchanged
    HOLD = "hold"  # swallowed
    RELEASE_SEND = "release send"  # the receive is swallowed and the held send goes up now


@dataclass(slots=True)
class FinishRecord:
    state: FinishState
    owner: int | None  # the child whose async load was in flight at the finish
    senders: tuple[int, ...]  # the children that delayed the free

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state.value, "owner": self.owner, "senders": list(self.senders)}


class Finishes:
    """Finish records of one node, keyed by request id (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[str, FinishRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, req_id: str) -> FinishRecord | None:
        return self._records.get(req_id)

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {req_id: rec.as_dict() for req_id, rec in self._records.items()}

    # ------------------------------------------------------------- transitions
    def finished(self, req_id: str, loading_owner: int | None, senders: tuple[int, ...]) -> None:
        """``request_finished``: ``loading_owner`` still loads into the request's blocks
        (``None``: no load in flight); ``senders`` delayed the free."""
        if loading_owner is None and not senders:
            return
        if not senders:
            state = FinishState.AWAITING_RECV
        elif loading_owner is None:
            state = FinishState.AWAITING_SENDS
        else:
            state = FinishState.AWAITING_RECV_AND_SENDS
        self._records[req_id] = FinishRecord(state, loading_owner, senders)

    def received(self, req_id: str) -> tuple[int | None, Signal]:
        """The receive (or failed receive) of a finished request arrived. Returns the child
        it belongs to (``None``: no child expected it) and what vLLM is shown."""
        record = self._records.get(req_id)
        if record is None:
            return None, Signal.PASS
        state = record.state
        if state is FinishState.AWAITING_RECV:
            del self._records[req_id]
            return record.owner, Signal.PASS
        if state is FinishState.AWAITING_RECV_AND_SENDS:
            record.state = FinishState.RECEIVED_AWAITING_SENDS
            return record.owner, Signal.HOLD
        if state is FinishState.SENT_AWAITING_RECV:
            del self._records[req_id]
            return record.owner, Signal.RELEASE_SEND
        if state is FinishState.RECEIVED_AWAITING_SENDS:
            return None, Signal.HOLD
        return None, Signal.PASS

    def sent(self, req_id: str) -> tuple[tuple[int, ...], Signal]:
        """The (already counted) send of a finished request arrived. Returns the children
        that delayed the free (empty: no child expected it) and what vLLM is shown."""
        record = self._records.get(req_id)
        if record is None:
            return (), Signal.PASS
        state = record.state
        if state is FinishState.AWAITING_SENDS or state is FinishState.RECEIVED_AWAITING_SENDS:
            del self._records[req_id]
            return record.senders, Signal.PASS
        if state is FinishState.AWAITING_RECV_AND_SENDS:
            record.state = FinishState.SENT_AWAITING_RECV
            return record.senders, Signal.HOLD
        if state is FinishState.SENT_AWAITING_RECV:
            return (), Signal.HOLD
        return (), Signal.PASS
