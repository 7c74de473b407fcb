"""One step's ``KVConnectorOutput``, shown to each child as if it were the only connector.

vLLM's scheduler hands the connector the step's completion signals once per step
(``update_connector_output``). Upstream MultiConnector hands every child everything, so a
child that tracks its failures blames itself for another child's failed load. Here each child
sees the receives and failures of the loads it owns (one receive for all of a stitched load's
children), the sends of the requests it delayed, its own worker metadata and KV events.

vLLM reads the finished sets after this call (``Scheduler._update_from_kv_xfer_finished``), so
the finish records' held signals (``kvcompose.composite.finishes.Finishes``) are taken out of
them here: a request that finished while loading, with a delayed free, shows vLLM one
``finished_sending`` once both its receive and its send happened. The same way, the receive
that ends a round of a stitched load with a failed segment is taken out (the request stays
parked) and the request queued in ``recovering`` for the scheduler half's next step
(``kvcompose.composite.stitch.StitchPlanner.recover``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvcompose.composite.finishes import Finishes, Signal
from kvcompose.composite.ledger import Ledger, LoadState
from kvcompose.composite.metadata import ComposedKVEvents, ComposedWorkerMeta

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput

    from kvcompose.composite.children import Children


class OutputRouter:
    """Splits one node's step output among its children (scheduler side)."""

    def __init__(self, ledger: Ledger, finishes: Finishes, children: Children) -> None:
        self.ledger = ledger
        self.finishes = finishes
        self.children = children
        #: receives held back for a recovery round, until the scheduler half's next
        #: ``build_connector_meta``: (request id, None) for this node's own stitched load,
        #: whose next round it plans; (request id, child) for a nested node's (the child's
        #: next receive is expected again)
        self.recovering: list[tuple[str, int | None]] = []
        self.refresh()

    def refresh(self) -> None:
        """Which children hear the output: those that implement ``update_connector_output``
        (vLLM's base class's own does nothing; ``Children.implementing``)."""
        self._listeners = self.children.implementing("update_connector_output")

    def route(self, connector_output: KVConnectorOutput) -> None:
        out = connector_output
        call = self.children.call
        listeners = self._listeners
        if not (
            out.finished_recving
            or out.failed_recving
            or out.finished_sending
            or out.kv_connector_worker_meta
            or out.kv_cache_events
            or out.invalid_block_ids
        ):
            for i in listeners:  # nothing to attribute: one shared view
                call(i, "update_connector_output", None, connector_output)
            return
        recv = connector_output.finished_recving or set()
        failed = connector_output.failed_recving or set()
        sent = connector_output.finished_sending or set()
        if connector_output.invalid_block_ids:
            self.ledger.exclude_owners_of_blocks(connector_output.invalid_block_ids)
        worker_meta = connector_output.kv_connector_worker_meta
        events = connector_output.kv_cache_events
        if not (recv or failed or sent or worker_meta or events):
            for i in listeners:
                call(i, "update_connector_output", None, connector_output)
            return
        held_recvs: list[str] = []  # finish records' decisions, applied after the children
        held_sends: list[str] = []
        released_sends: list[str] = []
        recv_by: dict[int, set[str]] = {}
        metas = worker_meta if isinstance(worker_meta, ComposedWorkerMeta) else None
        failed_by: dict[int, set[str]] = {}
        if metas is not None and metas.failed_segments:
            for req_id, children_failed in metas.failed_segments.items():
                self.ledger.segments_failed(req_id, children_failed)
                for child in children_failed:
                    failed_by.setdefault(child, set()).add(req_id)
        for req_id in recv | failed:
            record = self.ledger.get(req_id)
            if record is not None and (record.segments or record.owner is not None):
                loaders = record.receivers()
            else:
                loaders, signal = self.finishes.received(req_id)
                if signal is not Signal.PASS:
                    held_recvs.append(req_id)
                    if signal is Signal.RELEASE_SEND:
                        released_sends.append(req_id)
            settled = self.ledger.recv_finished(req_id, req_id in failed)
            if settled is not None and settled.state is LoadState.RECOVERING:
                held_recvs.append(req_id)  # vLLM keeps it parked for the next round
                self.recovering.append((req_id, None))
            for child in loaders:
                recv_by.setdefault(child, set()).add(req_id)
        sent_by: dict[int, set[str]] = {}
        for req_id in sent:
            senders, signal = self.finishes.sent(req_id)
            if signal is Signal.HOLD:
                held_sends.append(req_id)
            for child in senders:
                sent_by.setdefault(child, set()).add(req_id)
        child_metas = metas.children if metas is not None else None
        child_events = events.children if isinstance(events, ComposedKVEvents) else None
        for i in listeners:
            mine = recv_by.get(i, set())
            view = dataclasses.replace(
                connector_output,
                finished_recving=set(mine) or None,
                failed_recving=(mine & failed) | failed_by.get(i, set()),
                finished_sending=sent_by.get(i) or None,
                kv_connector_worker_meta=None if child_metas is None else child_metas[i],
                kv_cache_events=None if child_events is None else child_events[i],
            )
            call(i, "update_connector_output", None, view)
            if mine and len(view.finished_recving or ()) < len(mine):
                self._held_by_child(i, mine - (view.finished_recving or set()), held_recvs)
        if held_recvs or held_sends:
            _one_terminal_signal(connector_output, held_recvs, held_sends, released_sends)

    def _held_by_child(self, child: int, req_ids: set[str], held_recvs: list[str]) -> None:
        """A nested node took receives out of its view: those it holds back for a recovery
        round (its ledger says so) are held here too, and its next receive expected."""
        ledger = getattr(self.children.connectors[child], "ledger", None)
        if not isinstance(ledger, Ledger):
            return
        for req_id in req_ids:
            nested = ledger.get(req_id)
            if nested is not None and nested.state is LoadState.RECOVERING:
                held_recvs.append(req_id)
                self.ledger.receive_held(req_id, child)
                self.recovering.append((req_id, child))


def _one_terminal_signal(
    connector_output: KVConnectorOutput,
    held_recvs: list[str],
    held_sends: list[str],
    released_sends: list[str],
) -> None:
    """Apply the finish records' decisions (and the recoveries' held receives) to the sets
    vLLM's scheduler reads next."""
    out = connector_output
    for req_id in held_recvs:
        if out.finished_recving:
            out.finished_recving.discard(req_id)
        out.failed_recving.discard(req_id)
    for req_id in held_sends:
        out.finished_sending.discard(req_id)  # type: ignore[union-attr]
    if released_sends:
        out.finished_sending = (out.finished_sending or set()) | set(released_sends)
