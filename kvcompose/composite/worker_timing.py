"""How long each child's loads take, timed where they happen (``policy: fastest``).

- an **async** load: from the step its metadata reaches the worker half to the step its
  receive goes up (a failed load is not timed: it says nothing of the child's speed);
- a **sync** load: the time the child spends in ``start_load_kv`` and ``wait_for_layer_load``
  in its step, shared among its sync loads of that step by their blocks.

The times go to the scheduler half in ``ComposedWorkerMeta.load_seconds`` (vLLM aggregates
the ranks' worker metadata: the slowest rank's time counts), where each fits its child's
estimate (``kvcompose.composite.policies.fastest.costs``). Per request::

    (none) ── metadata: a load ──▶ STARTED ── its receive ──▶ (none; its time shipped,
                                      │                          unless the load failed)
                                      └────── request freed ─▶ (none)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvcompose.composite.metadata import CompositeMetadata


class LoadTimer:
    """The loads in flight on one node's worker half, and the times taken this step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started: dict[tuple[str, int], float] = {}
        # this step's sync loads per child: (request, blocks), and the child's loading time
        self._sync: dict[int, list[tuple[str, int]]] = {}
        self._sync_s: dict[int, float] = {}
        self._took: dict[tuple[str, int], float] = {}

    def on_metadata(self, metadata: CompositeMetadata) -> None:
        now = self.clock()
        for req_id, (owner, _) in metadata.loads.items():
            self._started[(req_id, owner)] = now
        for req_id, stitch in metadata.stitches.items():
            for child in stitch.waits:
                self._started[(req_id, child)] = now
        self._sync = {}
        for req_id, (owner, blocks) in metadata.sync_loads.items():
            self._sync.setdefault(owner, []).append((req_id, len(blocks)))
        for req_id, segments in metadata.sync_segments.items():
            for child, blocks in segments:
                self._sync.setdefault(child, []).append((req_id, len(blocks)))

    def loads_sync(self, child: int) -> bool:
        """Whether ``child`` has sync loads this step (its loading calls are then timed)."""
        return child in self._sync

    def add_sync(self, child: int, seconds: float) -> None:
        self._sync_s[child] = self._sync_s.get(child, 0.0) + seconds

    def received(self, req_id: str, child: int, *, failed: bool = False) -> None:
        """The load's receive: its time is taken, unless it failed (it says nothing of the
        child's speed)."""
        started = self._started.pop((req_id, child), None)
        if started is not None and not failed:
            self._took[(req_id, child)] = self.clock() - started

    def forget(self, req_ids: Iterable[str]) -> None:
        """Freed requests: a load still in flight will not be timed."""
        if self._started:
            for req_id in req_ids:
                for key in [k for k in self._started if k[0] == req_id]:
                    del self._started[key]

    def take(self) -> dict[tuple[str, int], float]:
        """This step's times (at the end of the step, for the worker metadata)."""
        took, self._took = self._took, {}
        for child, loads in self._sync.items():
            seconds = self._sync_s.get(child, 0.0)
            blocks = sum(n for _, n in loads) or 1
            for req_id, n in loads:
                took[(req_id, child)] = seconds * n / blocks
        self._sync, self._sync_s = {}, {}
        return took

    def live(self) -> list[tuple[str, int]]:
        return sorted(self._started)
