"""The completion signals the worker half of a composite node lets up to vLLM (``WorkerSignals``).

vLLM's scheduler crashes on a ``finished_recving`` for a request that is not waiting for remote
KV, and frees blocks early (then crashes) on a premature or duplicate ``finished_sending``
(``Scheduler._update_from_kv_xfer_finished``; see "Completion-signal invariants" in
../shared/reference/vllm-connector-contract.md). So the worker half of every composite node
filters what its children report:

- **receives**: a request's ``finished_recving``/``failed_recving`` goes up only from the child
  the scheduler side named as its load owner (shipped in ``CompositeMetadata.loads`` with the
  blocks the load writes), and only once per load. Anything else is a contract violation,
  dropped and counted.
- **sends**: the scheduler side ships, per finished request, which children asked to delay the
  free (``CompositeMetadata.sends``). ``finished_sending`` goes up once all of them reported.
  A child reporting a send it never asked for is a violation, dropped and counted.
- **stitched loads** (several children load one request, each its own range): the scheduler
  side ships which children's async segments a parked request waits for
  (``CompositeMetadata.stitches``); one ``finished_recving`` goes up once all of them
  reported (an abort waits for all of them too: vLLM frees the blocks on that signal). A
  failed segment of a parked load (its child's ``failed_recving``, a raise, or invalid
  blocks inside its range) is *not* shown to vLLM: the ``finished_recving`` goes up as if
  it had loaded and the failed children reach the scheduler side in
  ``ComposedWorkerMeta.failed_segments``, which takes the request out of that receive (it
  stays parked) and plans the next round: another child reloads the gap, or the worker is
  told what to give up (``StitchLoad.invalid``/``failed``) with that round's receive.
  A sync stitched load that was not parked passes its failures straight up (invalid blocks).

A child that raises while loading has its loads failed (``kvcompose.composite.worker``), but
its transfers may go on. Once vLLM has heard that a load failed, it frees the request's blocks
(or cuts it back) and hands them to other requests, so the child's late reports for that load
are *fenced*: its receive is dropped, and bad block ids it names inside the failed load's
blocks are dropped too (they would name another request's blocks by then), also while another
child owns the request's next load. A fence ends in the step the child reports its first receive
for the request after the raise, or, block by block, when the scheduler side gives the same child
a new load of those blocks. If the request's new load is the same child's, that receive goes up
as the new load's: a child reports by request id, so the two cannot be told apart (a node
excludes the failed child from the request's next lookup, so this is the rarer case).

Tables empty themselves as signals go up; ``live()`` shows what is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvcompose.composite.guard import Guard
from kvcompose.composite.metadata import CompositeMetadata, StitchLoad


class WorkerSignals:
    """One terminal signal per request, from the right child."""

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._recv_owner: dict[str, int] = {}
        self._recv_blocks: dict[str, tuple[int, ...]] = {}
        # child -> request -> blocks of its loads failed for a raise (see the module docstring)
        self._fences: dict[int, dict[str, frozenset[int]]] = {}
        self._fences_ending: list[tuple[int, str]] = []
        self._send_waiting: dict[str, set[int]] = {}
        self._sync_loads: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        # stitched loads: request -> children whose async segments are awaited
        self._stitch_waits: dict[str, set[int]] = {}
        self._stitch_blocks: dict[str, dict[int, tuple[int, ...]]] = {}
        self._stitch_failed: dict[str, set[int]] = {}
        self._sync_segments: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {}
        # what the scheduler side gave up, reported with the round's receive
        self._stitch_release: dict[str, tuple[tuple[int, ...], bool]] = {}
        # rounds whose receive went up this step (a child may report their blocks invalid
        # after it, in get_block_ids_with_load_errors)
        self._stitch_ended: dict[str, dict[int, tuple[int, ...]]] = {}
        self._segment_failures: dict[str, frozenset[int]] = {}

    def on_metadata(self, metadata: CompositeMetadata) -> None:
        for req_id, (owner, blocks) in metadata.loads.items():
            self._recv_owner[req_id] = owner
            self._recv_blocks[req_id] = blocks
        self._sync_loads = metadata.sync_loads
        if self._fences:
            self._unfence(metadata)
        for req_id, children in metadata.sends.items():
            self._send_waiting[req_id] = set(children)
        self._sync_segments = metadata.sync_segments
        if metadata.invalid_blocks:
            self._failed_blocks.update(metadata.invalid_blocks)
        for req_id, stitch in metadata.stitches.items():
            self._add_stitch(req_id, stitch)

    def _add_stitch(self, req_id: str, stitch: StitchLoad) -> None:
        self._stitch_waits[req_id] = set(stitch.waits)
        self._stitch_blocks[req_id] = dict(stitch.blocks)
        self._stitch_failed[req_id] = set()
        if stitch.invalid or stitch.failed:
            self._stitch_release[req_id] = (stitch.invalid, stitch.failed)

    def _unfence(self, metadata: CompositeMetadata) -> None:
        """A child's new loads lift its fences on their blocks: errors there are the new
        load's."""
        loads = [*metadata.loads.values(), *metadata.sync_loads.values()]
        loads += [seg for segments in metadata.sync_segments.values() for seg in segments]
        for stitch in metadata.stitches.values():
            loads += stitch.blocks.items()
        for child, blocks in loads:
            fences = self._fences.get(child)
            if fences:
                for req_id, fenced in list(fences.items()):
                    # an emptied fence stays: the failed load's late receive is still dropped
                    fences[req_id] = fenced.difference(blocks)

    def _fence(self, child: int, req_id: str, blocks: tuple[int, ...]) -> None:
        self._fences.setdefault(child, {})[req_id] = frozenset(blocks)

    def fail_loads_of(self, child: int, reporting: set[str] | frozenset[str] = frozenset()) -> None:
        """``child`` raised on the worker: its loads cannot be trusted. Its async loads in
        flight are reported failed (once) and fenced, its sync loads of this step as failed
        blocks, so vLLM recomputes (or fails) those requests instead of using garbage or
        waiting forever. ``reporting``: requests whose receive the child reports this step
        (marked failed by the caller), left to that report."""
        for req_id, owner in self._recv_owner.items():
            if owner == child and req_id not in reporting:
                self._failed_loads.add(req_id)
                self._fence(child, req_id, self._recv_blocks.get(req_id, ()))
        for owner, blocks in self._sync_loads.values():
            if owner == child:
                self._failed_blocks.update(blocks)
        for req_id, segments in self._sync_segments.items():
            for loader, blocks in segments:
                if loader == child:
                    parked = self._stitch_failed.get(req_id)
                    if parked is not None:  # the scheduler side recovers it
                        parked.add(child)
                    else:
                        self._failed_blocks.update(blocks)
        for req_id, waits in self._stitch_waits.items():
            if child in waits and req_id not in reporting:
                waits.discard(child)
                self._stitch_failed[req_id].add(child)
                self._fence(child, req_id, self._stitch_blocks[req_id].get(child, ()))

    def take_segment_failures(self) -> dict[str, frozenset[int]]:
        """Parked stitched loads whose segments failed since the last call (once a step)."""
        failures, self._segment_failures = self._segment_failures, {}
        self._stitch_ended.clear()
        return failures

    def claim_segment_errors(self, child: int, blocks: set[int]) -> set[int]:
        """``child`` reported ``blocks`` as failed loads: those inside its segment of a
        parked stitched load (in flight, or ended this step) fail that segment instead of
        going up to vLLM. Returns the rest."""
        if not (self._stitch_blocks or self._stitch_ended):
            return blocks
        left = set(blocks)
        for table, in_flight in ((self._stitch_blocks, True), (self._stitch_ended, False)):
            for req_id, by_child in table.items():
                mine = by_child.get(child)
                if not mine or left.isdisjoint(mine):
                    continue
                left.difference_update(mine)
                if in_flight:
                    self._stitch_failed[req_id].add(child)
                else:
                    failed = self._segment_failures.get(req_id, frozenset())
                    self._segment_failures[req_id] = failed | {child}
        return left

    def claim_errors(self, child: int, blocks: set[int]) -> set[int]:
        """What of ``child``'s reported bad blocks goes up to vLLM: not those of its fenced
        loads (dropped, counted), not those a parked stitch's segment claims."""
        fences = self._fences.get(child)
        if fences:
            fenced = blocks.intersection(set().union(*fences.values()))
            if fenced:
                blocks = blocks - fenced
                self._guard.fenced(child, f"bad blocks {sorted(fenced)} of a failed load")
        return self.claim_segment_errors(child, blocks) if blocks else blocks

    def end_fences(self) -> None:
        """After the step's errors were taken: fences whose late receive came this step end."""
        for child, req_id in self._fences_ending:
            fences = self._fences.get(child)
            if fences is not None:
                fences.pop(req_id, None)
                if not fences:
                    del self._fences[child]
        self._fences_ending.clear()

    def take_failed_blocks(self) -> set[int]:
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def combine(
        self, results: Sequence[KVConnectorTransferResults | None]
    ) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
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
                waits = self._stitch_waits.get(req_id)
                if waits is not None and child in waits:
                    waits.discard(child)
                    if req_id in result.failed_recving:
                        self._stitch_failed[req_id].add(child)
                    continue
                owner = self._recv_owner.get(req_id)
                if self._fences and req_id in self._fences.get(child, ()):
                    # the fence ends with the child's first receive for the request after
                    # its raise; it is the failed load's unless the child owns a new one
                    self._fences_ending.append((child, req_id))
                    if owner != child:
                        self._guard.fenced(child, f"receive of {req_id}'s failed load")
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
                if req_id in result.failed_recving:
                    out.failed_recving.add(req_id)
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
        self._finish_stitches(out)
        return out

    def _finish_stitches(self, out: KVConnectorTransferResults) -> None:
        """One ``finished_recving`` per round of a stitched load whose async segments all
        reported; its failed segments go to the scheduler side, what the scheduler side gave
        up goes up with it."""
        done = [req_id for req_id, waits in self._stitch_waits.items() if not waits]
        for req_id in done:
            del self._stitch_waits[req_id]
            self._stitch_ended[req_id] = self._stitch_blocks.pop(req_id)
            failed = self._stitch_failed.pop(req_id)
            out.finished_recving.add(req_id)
            if failed:
                self._segment_failures[req_id] = frozenset(failed)
            release = self._stitch_release.pop(req_id, None)
            if release is not None:
                invalid, request_failed = release
                self._failed_blocks.update(invalid)
                if request_failed:
                    out.failed_recving.add(req_id)

    def live(self) -> dict[str, object]:
        tables: dict[str, object] = {}
        if self._recv_owner:
            tables["loads_in_flight"] = dict(self._recv_owner)
        if self._send_waiting:
            tables["sends_waiting"] = {k: sorted(v) for k, v in self._send_waiting.items()}
        if self._stitch_waits:
            tables["stitches_in_flight"] = {k: sorted(v) for k, v in self._stitch_waits.items()}
        if self._fences:
            tables["fenced_loads"] = {
                child: sorted(fences) for child, fences in self._fences.items()
            }
        return tables
