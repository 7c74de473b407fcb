"""The completion signals the worker half of a composite node lets up to vLLM (``WorkerSignals``).

vLLM's scheduler crashes on a ``finished_recving`` for a request that is not waiting for remote
KV, and frees blocks early (then crashes) on a premature or duplicate ``finished_sending``
(``Scheduler._update_from_kv_xfer_finished``; "One terminal signal per request" in
docs/concepts.md). So the worker half of every composite node filters what its children
report:

- **receives**: a request's ``finished_recving``/``failed_recving`` goes up only from the child
  the scheduler side named as its load owner (shipped in ``CompositeMetadata.loads`` with the
  blocks the load writes), and only once per load. Anything else is a contract violation,
  dropped and counted.
- **sends**: the scheduler side ships, per finished request, which children asked to delay the
  free (``CompositeMetadata.sends``). ``finished_sending`` goes up once all of them reported.
  A child reporting a send it never asked for is a violation, dropped and counted.
- **stitched loads**: one receive per round, failed segments hidden from vLLM
  (``kvcompose.composite.worker_stitches.StitchRounds``).
- **fences**: a child's late reports for loads failed for its raise are dropped
  (``kvcompose.composite.worker_fences.Fences``).
- **several KV cache groups** (``CompositeMetadata.by_request``): vLLM takes no invalid block
  ids there, so a child's bad blocks that no parked stitch's segment of it claims fail the
  child's loads by request (``fail_by_request``).

Tables empty themselves as signals go up; ``live()`` shows what is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.composite.guard import Guard
from kvcompose.composite.metadata import CompositeMetadata
from kvcompose.composite.worker_fences import Fences
from kvcompose.composite.worker_stitches import StitchRounds
from kvcompose.composite.worker_timing import LoadTimer


class WorkerSignals:
    """One terminal signal per request, from the right child."""

    def __init__(self, guard: Guard, timer: LoadTimer | None = None) -> None:
        self._guard = guard
        self.timer = timer  # ``fastest``: loads timed
        self._recv_owner: dict[str, int] = {}
        self._recv_blocks: dict[str, tuple[int, ...]] = {}
        self._send_waiting: dict[str, set[int]] = {}
        self._sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._freed: list[str] = []  # finished this step, no send holding their blocks
        self.fences = Fences(guard)
        self.stitches = StitchRounds()
        self.by_request = False  # several KV cache groups: failures by request only
        self._step_receives: dict[int, set[str]] = {}  # by_request: owned receives sent up

    def on_metadata(self, metadata: CompositeMetadata) -> None:
        for req_id, (owner, blocks) in metadata.loads.items():
            self._recv_owner[req_id] = owner
            self._recv_blocks[req_id] = blocks
        self._sync_loads = metadata.sync_loads
        if self.fences:
            self.fences.lift(self._step_loads(metadata))
        for req_id, children in metadata.sends.items():
            self._send_waiting[req_id] = set(children)
        if metadata.invalid_blocks:
            self._failed_blocks.update(metadata.invalid_blocks)
        self.stitches.on_metadata(metadata)
        self.by_request = metadata.by_request
        if self.timer is not None:
            self.timer.on_metadata(metadata)

    @staticmethod
    def _step_loads(metadata: CompositeMetadata) -> list[tuple[int, tuple[int, ...]]]:
        """Every (child, blocks) the step's metadata gives a load of."""
        loads = [*metadata.loads.values(), *metadata.sync_loads.values()]
        loads += [seg for segments in metadata.sync_segments.values() for seg in segments]
        for stitch in metadata.stitches.values():
            loads += stitch.blocks.items()
        return loads

    def fail_loads_of(self, child: int, reporting: set[str] | frozenset[str] = frozenset()) -> None:
        """``child`` raised on the worker: its loads cannot be trusted. Its async loads in
        flight are reported failed (once) and fenced, its sync loads of this step as failed
        blocks, so vLLM recomputes (or fails) those requests instead of using garbage or
        waiting forever. ``reporting``: requests whose receive the child reports this step
        (marked failed by the caller), left to that report."""
        for req_id, owner in self._recv_owner.items():
            if owner == child and req_id not in reporting:
                self._failed_loads.add(req_id)
                self.fences.fence(child, req_id, self._recv_blocks.get(req_id, ()))
        for owner, blocks in self._sync_loads.values():
            if owner == child:
                self._failed_blocks.update(blocks)
        invalid, fenced = self.stitches.fail_child(child, reporting)
        self._failed_blocks.update(invalid)
        for req_id, blocks in fenced:
            self.fences.fence(child, req_id, blocks)

    def fail_by_request(self, child: int, out: KVConnectorTransferResults | None) -> None:
        """Several KV cache groups: ``child`` named bad blocks that no segment of it claims
        (block ids are unique only within a group, so they cannot name a request, and vLLM
        refuses them). Every load of the child that may hold them fails by request: its
        segments of parked stitched loads (in flight, or whose round ended this step), the
        receives it reports this step (``out``, going up failed); if it has none, its loads
        in flight, as if it raised. Bad blocks that come with a late receive the fences
        dropped, or from a child loading nothing that once had a fence, are that failed
        load's late report (``Fences.late_report``): dropped, counted."""
        hit = self.stitches.fail_segments_of(child)
        mine = self._step_receives.get(child)
        if mine and out is not None:
            out.failed_recving |= mine
            hit = True
        if hit:
            return
        loading = any(owner == child for owner in self._recv_owner.values())
        if self.fences.late_report(child, "bad blocks of a failed load, late", loading=loading):
            return
        if loading:
            self.fail_loads_of(child)
            return
        self._guard.violation(
            child, "unowned_bad_blocks", "named bad blocks while loading nothing; dropped"
        )

    def take_segment_failures(self) -> dict[str, frozenset[int]]:
        """Parked stitched loads whose segments failed since the last call (once a step)."""
        return self.stitches.take_failures()

    def claim_errors(self, child: int, blocks: set[int]) -> set[int]:
        """What of ``child``'s reported bad blocks goes up to vLLM: not those of its fenced
        loads (dropped, counted), not those a parked stitch's segment claims."""
        blocks = self.fences.drop(child, blocks)
        return self.stitches.claim_errors(child, blocks) if blocks else blocks

    def end_fences(self) -> None:
        """After the step's errors were taken: the fences whose late receive came this step,
        and those of requests vLLM freed, end."""
        self.fences.end_step()
        if self._freed:
            self.fences.end_freed(self._freed)
            self._freed = []

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def combine(
        self,
        results: Sequence[KVConnectorTransferResults | None],
        finished_req_ids: set[str] | frozenset[str] = frozenset(),
    ) -> KVConnectorTransferResults:
        """The children's transfer results, filtered into what goes up to vLLM.
        ``finished_req_ids``: the requests vLLM finished since the last step (their blocks
        are freed unless a child's send holds them)."""
        out = KVConnectorTransferResults()
        by_request = self.by_request
        if by_request:
            self._step_receives = {}
        for req_id in self._failed_loads:
            self._recv_blocks.pop(req_id, None)
            if self._recv_owner.pop(req_id, None) is not None:
                out.finished_recving.add(req_id)
                out.failed_recving.add(req_id)
        self._failed_loads.clear()
        for child, result in enumerate(results):
            if result is None:
                continue
            for req_id in result.finished_recving | result.failed_recving:
                failed = req_id in result.failed_recving
                if self.stitches.receive(child, req_id, failed):
                    if self.timer is not None:
                        self.timer.received(req_id, child, failed=failed)
                    continue
                owner = self._recv_owner.get(req_id)
                if self.fences and self.fences.receive(child, req_id, owner):
                    continue
                if owner != child:
                    kind = "foreign_recv" if owner is not None else "unexpected_recv"
                    self._guard.violation(
                        child, kind, f"finished_recving for {req_id} (owner: {owner})"
                    )
                    continue
                del self._recv_owner[req_id]
                self._recv_blocks.pop(req_id, None)
                out.finished_recving.add(req_id)
                if failed:
                    out.failed_recving.add(req_id)
                if by_request:
                    self._step_receives.setdefault(child, set()).add(req_id)
                if self.timer is not None:
                    self.timer.received(req_id, child, failed=failed)
            for req_id in result.finished_sending:
                waiting = self._send_waiting.get(req_id)
                if waiting is None or child not in waiting:
                    self._guard.violation(
                        child, "unexpected_send", f"finished_sending for {req_id} it did not delay"
                    )
                    continue
                waiting.discard(child)
                if not waiting:
                    del self._send_waiting[req_id]
                    out.finished_sending.add(req_id)
                    if self.fences:  # vLLM frees the request's blocks on this signal
                        self._freed.append(req_id)
        for req_id, invalid, request_failed in self.stitches.finish():
            out.finished_recving.add(req_id)
            self._failed_blocks.update(invalid)
            if request_failed:
                out.failed_recving.add(req_id)
        if self.fences and finished_req_ids:
            self._freed += [r for r in finished_req_ids if r not in self._send_waiting]
        if self.timer is not None and finished_req_ids:
            self.timer.forget(finished_req_ids)
        return out

    def live(self) -> dict[str, object]:
        tables: dict[str, object] = {}
        if self._recv_owner:
            tables["loads_in_flight"] = dict(self._recv_owner)
        if self._send_waiting:
            tables["sends_waiting"] = {k: sorted(v) for k, v in self._send_waiting.items()}
        if stitches := self.stitches.live():
            tables["stitches_in_flight"] = stitches
        if fenced := self.fences.live():
            tables["fenced_loads"] = fenced
        if self.timer is not None and (timed := self.timer.live()):
            tables["loads_timed"] = timed
        return tables
