"""Worker side: turn the children's completion signals into one terminal signal per request.

vLLM's scheduler crashes on a ``finished_recving`` for a request that is not waiting for remote
KV, and frees blocks early (then crashes) on a premature or duplicate ``finished_sending``
(contract §2.7). So the worker half of every composite node filters what its children report:

- **receives**: a request's ``finished_recving``/``failed_recving`` goes up only from the child
  the scheduler side named as its load owner (shipped in ``CompositeMetadata.loads``), and only
  once per load. Anything else is a contract violation, dropped and counted.
- **sends**: the scheduler side ships, per finished request, which children asked to delay the
  free (``CompositeMetadata.sends``). ``finished_sending`` goes up once all of them reported.
  A child reporting a send it never asked for is a violation, dropped and counted.

Tables empty themselves as signals go up; ``live()`` shows what is still in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.guard import Guard
from kvcompose.metadata import CompositeMetadata


class WorkerSignals:
    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._recv_owner: dict[str, int] = {}
        self._send_waiting: dict[str, set[int]] = {}
        self._sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()

    def on_metadata(self, metadata: CompositeMetadata) -> None:
        self._recv_owner.update(metadata.loads)
        self._sync_loads = metadata.sync_loads
        for req_id, children in metadata.sends.items():
            self._send_waiting[req_id] = set(children)

    def fail_loads_of(self, child: int) -> None:
        """``child`` raised on the worker: its loads cannot be trusted. Its async loads in
        flight are reported failed (once), its sync loads of this step as failed blocks, so
        vLLM recomputes (or fails) those requests instead of using garbage or waiting forever."""
        self._failed_loads.update(r for r, owner in self._recv_owner.items() if owner == child)
        for owner, blocks in self._sync_loads.values():
            if owner == child:
                self._failed_blocks.update(blocks)

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def combine(self, results: Sequence[KVConnectorTransferResults | None]
                ) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        for req_id in self._failed_loads:
            if self._recv_owner.pop(req_id, None) is not None:
                out.finished_recving.add(req_id)
                out.failed_recving.add(req_id)
        self._failed_loads.clear()
        for child, result in enumerate(results):
            if result is None:
                continue
            for req_id in result.finished_recving | result.failed_recving:
                owner = self._recv_owner.get(req_id)
                if owner != child:
                    kind = "foreign_recv" if owner is not None else "unexpected_recv"
                    self._guard.violation(child, kind, f"finished_recving for {req_id} "
                                          f"(owner: {owner})")
                    continue
                del self._recv_owner[req_id]
                out.finished_recving.add(req_id)
                if req_id in result.failed_recving:
                    out.failed_recving.add(req_id)
            for req_id in result.finished_sending:
                waiting = self._send_waiting.get(req_id)
                if waiting is None or child not in waiting:
                    self._guard.violation(child, "unexpected_send",
                                          f"finished_sending for {req_id} it did not delay")
                    continue
                waiting.discard(child)
                if not waiting:
                    del self._send_waiting[req_id]
                    out.finished_sending.add(req_id)
        return out

    def live(self) -> dict[str, object]:
        tables: dict[str, object] = {}
        if self._recv_owner:
            tables["loads_in_flight"] = dict(self._recv_owner)
        if self._send_waiting:
            tables["sends_waiting"] = {k: sorted(v) for k, v in self._send_waiting.items()}
        return tables
