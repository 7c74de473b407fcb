"""Stitched loads on the worker half: one receive per round, failed segments hidden from vLLM.

The scheduler half ships, per parked stitched load, which children's async segments the round
waits for and each segment's blocks (``CompositeMetadata.stitches``); ``StitchRounds`` lets one
``finished_recving`` up once all of them reported (an abort waits for all of them too: vLLM
frees the blocks on that signal). A failed segment of a parked load (its child's
``failed_recving``, a raise, or invalid blocks inside its range) is *not* shown to vLLM: the
``finished_recving`` goes up as if it had loaded and the failed children reach the scheduler
half in ``ComposedWorkerMeta.failed_segments``, which takes the request out of that receive (it
stays parked) and plans the next round (``kvcompose.composite.stitch.StitchPlanner.recover``):
another child reloads the gap, or the worker is told what to give up (``StitchLoad.invalid`` /
``failed``) with that round's receive. A sync stitched load that was not parked passes its
failures straight up (invalid blocks).
"""

from __future__ import annotations

from kvcompose.composite.metadata import CompositeMetadata, StitchLoad

SyncSegments = tuple[tuple[int, tuple[int, ...]], ...]


class StitchRounds:
    """The stitched loads' rounds in flight on one node's worker half."""

    def __init__(self) -> None:
        # request -> children whose async segments the round waits for
        self._waits: dict[str, set[int]] = {}
        self._blocks: dict[str, dict[int, tuple[int, ...]]] = {}
        self._failed: dict[str, set[int]] = {}
        self._sync_segments: dict[str, SyncSegments] = {}
        # what the scheduler half gave up, reported with the round's receive
        self._release: dict[str, tuple[tuple[int, ...], bool]] = {}
        # rounds whose receive went up this step (a child may report their blocks invalid
        # after it, in get_block_ids_with_load_errors)
        self._ended: dict[str, dict[int, tuple[int, ...]]] = {}
        self._segment_failures: dict[str, frozenset[int]] = {}

    def on_metadata(self, metadata: CompositeMetadata) -> None:
        self._sync_segments = metadata.sync_segments
        for req_id, stitch in metadata.stitches.items():
            self._add(req_id, stitch)

    def _add(self, req_id: str, stitch: StitchLoad) -> None:
        self._waits[req_id] = set(stitch.waits)
        self._blocks[req_id] = dict(stitch.blocks)
        self._failed[req_id] = set()
        if stitch.invalid or stitch.failed:
            self._release[req_id] = (stitch.invalid, stitch.failed)

    def fail_child(
        self, child: int, reporting: set[str] | frozenset[str]
    ) -> tuple[set[int], list[tuple[str, tuple[int, ...]]]]:
        """``child`` raised: its sync segments of this step and its awaited async segments
        fail. Returns the blocks to report invalid (sync segments of loads not parked) and the
        async segments taken from their rounds, to fence (request, blocks); ``reporting``:
        requests whose receive the child reports this step, left to that report."""
        invalid: set[int] = set()
        for req_id, segments in self._sync_segments.items():
            for loader, blocks in segments:
                if loader == child:
                    parked = self._failed.get(req_id)
                    if parked is not None:  # the scheduler half recovers it
                        parked.add(child)
                    else:
                        invalid.update(blocks)
        fenced: list[tuple[str, tuple[int, ...]]] = []
        for req_id, waits in self._waits.items():
            if child in waits and req_id not in reporting:
                waits.discard(child)
                self._failed[req_id].add(child)
                fenced.append((req_id, self._blocks[req_id].get(child, ())))
        return invalid, fenced

    def receive(self, child: int, req_id: str, failed: bool) -> bool:
        """``child`` reports its receive for ``req_id``: True if it was an awaited segment's
        (taken here, not a receive of its own)."""
        waits = self._waits.get(req_id)
        if waits is None or child not in waits:
            return False
        waits.discard(child)
        if failed:
            self._failed[req_id].add(child)
        return True

    def claim_errors(self, child: int, blocks: set[int]) -> set[int]:
        """``child`` reported ``blocks`` as failed loads: those inside its segment of a parked
        stitched load (in flight, or ended this step) fail that segment instead of going up
        to vLLM. Returns the rest."""
        if not (self._blocks or self._ended):
            return blocks
        left = set(blocks)
        for table, in_flight in ((self._blocks, True), (self._ended, False)):
            for req_id, by_child in table.items():
                mine = by_child.get(child)
                if not mine or left.isdisjoint(mine):
                    continue
                left.difference_update(mine)
                if in_flight:
                    self._failed[req_id].add(child)
                else:
                    failed = self._segment_failures.get(req_id, frozenset())
                    self._segment_failures[req_id] = failed | {child}
        return left

    def fail_segments_of(self, child: int) -> bool:
        """Several KV cache groups: ``child`` named bad blocks no segment claims by its block
        ids (group 0's, while the child may name another group's): every segment of it in a
        parked stitched load, in flight or whose round ended this step, fails. Returns
        whether there was one."""
        hit = False
        for req_id, by_child in self._blocks.items():
            if child in by_child:
                self._failed[req_id].add(child)
                hit = True
        for req_id, by_child in self._ended.items():
            if child in by_child:
                failed = self._segment_failures.get(req_id, frozenset())
                self._segment_failures[req_id] = failed | {child}
                hit = True
        return hit

    def finish(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """Rounds whose async segments all reported: (request, blocks given up, whether the
        request goes up failed), one receive each. Their failed segments wait for the
        scheduler half (``take_failures``)."""
        done = [req_id for req_id, waits in self._waits.items() if not waits]
        ended: list[tuple[str, tuple[int, ...], bool]] = []
        for req_id in done:
            del self._waits[req_id]
            self._ended[req_id] = self._blocks.pop(req_id)
            failed = self._failed.pop(req_id)
            if failed:
                self._segment_failures[req_id] = frozenset(failed)
            invalid, request_failed = self._release.pop(req_id, ((), False))
            ended.append((req_id, invalid, request_failed))
        return ended

    def take_failures(self) -> dict[str, frozenset[int]]:
        """Parked stitched loads whose segments failed since the last call (once a step)."""
        failures, self._segment_failures = self._segment_failures, {}
        self._ended.clear()
        return failures

    def live(self) -> dict[str, list[int]]:
        return {req_id: sorted(waits) for req_id, waits in self._waits.items()}
