"""The per-request state machine of one composite node after ``request_finished`` (scheduler
side).

A finished request may still expect completion signals: the receive of an async load that was
in flight (an abort while loading; vLLM keeps the blocks until it arrives) and the send of the
children that delayed the free (``request_finished`` → ``True``, or an accepted partial tail).
vLLM frees the request on the first terminal signal and asserts on a second, and a send
arriving first would free blocks the owner still loads into. So when both are expected, the
node swallows the receive and holds the send until both happened; vLLM sees one
``finished_sending``. One ``FinishRecord`` per such request::

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
    # the children whose async load was in flight at the finish: the owner, or a stitched
    # load's children still loading (the worker sends one receive for all of them); empty
    # when no load was in flight, or when a stitch's in-flight load has no async segment
    # left (the worker then signals its end itself)
    loaders: tuple[int, ...]
    senders: tuple[int, ...]  # the children that delayed the free

    def as_dict(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "loaders": list(self.loaders),
            "senders": list(self.senders),
        }


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
    def finished(
        self, req_id: str, loaders: tuple[int, ...] | None, senders: tuple[int, ...]
    ) -> None:
        """``request_finished``: ``loaders`` still load into the request's blocks (``None``:
        no load in flight; see ``FinishRecord.loaders``); ``senders`` delayed the free."""
        if loaders is None and not senders:
            return
        if not senders:
            state = FinishState.AWAITING_RECV
        elif loaders is None:
            state = FinishState.AWAITING_SENDS
        else:
            state = FinishState.AWAITING_RECV_AND_SENDS
        self._records[req_id] = FinishRecord(state, loaders or (), senders)

    def received(self, req_id: str) -> tuple[tuple[int, ...], Signal]:
        """The receive (or failed receive) of a finished request arrived. Returns the children
        it belongs to (empty: no child expected it) and what vLLM is shown."""
        record = self._records.get(req_id)
        if record is None:
            return (), Signal.PASS
        state = record.state
        if state is FinishState.AWAITING_RECV:
            del self._records[req_id]
            return record.loaders, Signal.PASS
        if state is FinishState.AWAITING_RECV_AND_SENDS:
            record.state = FinishState.RECEIVED_AWAITING_SENDS
            return record.loaders, Signal.HOLD
        if state is FinishState.SENT_AWAITING_RECV:
            del self._records[req_id]
            return record.loaders, Signal.RELEASE_SEND
        if state is FinishState.RECEIVED_AWAITING_SENDS:
            return (), Signal.HOLD
        return (), Signal.PASS

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
