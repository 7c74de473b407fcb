"""The background writer: chunk saves leave the engine step and go to one thread.

Why: a synchronous save writes every layer's blocks into a file inside
``wait_for_save``, i.e. inside the engine step, so on traffic with many new prompts the
writes decide the step time. With ``save_mode: background`` the step only queues a
:class:`WriteJob` (block ids and a reference to the layer caches); this thread writes the
file from the blocks later.

That is only correct while the blocks keep their content, which the scheduler half
guarantees with vLLM's delayed free: ``request_finished`` returns ``True`` for a request
with saves planned, the next step's metadata carries the finish notice, and the worker
reports the request in ``finished_sending`` once its last job is written or dropped
(``Scheduler._update_from_kv_xfer_finished`` frees the blocks then). A preempted request's
blocks are freed at once (vLLM calls no connector method), so the worker writes its queued
jobs itself, before the step's forward can reuse the blocks (:meth:`ChunkWriter.write_now`).

A chunk that is queued or being written is already offered to lookups (the scheduler half
counts it as stored until the worker reports it written or dropped, :meth:`take_outcomes`):
a load of it copies the held source blocks directly (:meth:`job_for`), so the next turn of
a conversation that arrives before the file is written still hits.

Under several KV cache groups vLLM frees a windowed group's blocks behind the window while
the request runs, which no delayed free covers, so those layers' blocks are copied when the
job is queued (:attr:`WriteJob.copies`); the full-attention layers are still written from
the held blocks.

The queue is bounded (``max_pending_saves`` chunks): when it is full a save is dropped and
counted instead of stalling the step; a dropped save is a future miss, never wrong data.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvcompose.stores.prefix.groups import KVGroups

logger = logging.getLogger(__name__)


@dataclass
class WriteJob:
    """Save one chunk: the request's blocks ``block_ids`` of every layer in ``caches``."""

    key: str
    req_id: str
    block_ids: list[int]
    num_tokens: int
    caches: dict[str, torch.Tensor]
    #: The KV cache event to publish once written (None: events off).
    event: Any = None
    #: Several KV cache groups: the chunk's block ids per group (None: ``block_ids``).
    groups: list[list[int]] | None = None
    #: Layer -> its blocks of the chunk, copied when queued (blocks at dim 0).
    copies: dict[str, torch.Tensor] = field(default_factory=dict)

    def source(self, layer: str, groups: KVGroups | None) -> tuple[torch.Tensor, list[int]]:
        """Where ``layer``'s blocks of the chunk are: a tensor and their indices in it (the
        copy, or the layer's cache as registered, not viewed by block)."""
        copy = self.copies.get(layer)
        if copy is not None:
            return copy, list(range(copy.shape[0]))
        if self.groups is None or groups is None:
            return self.caches[layer], self.block_ids
        return self.caches[layer], self.groups[groups.group_of(layer)]


class ChunkWriter:
    """A bounded queue of :class:`WriteJob` and the thread that runs ``write``.

    It also keeps, per request, how many jobs are not done yet, so that a finished
    request's blocks are released (``take_finished``) exactly when its last write is over.
    """

    def __init__(self, write: Callable[[WriteJob], bool], max_pending: int) -> None:
        self._write = write
        self.max_pending = max_pending
        self._cv = threading.Condition()
        self._queue: deque[WriteJob] = deque()
        #: Key -> its job, queued or being written.
        self._jobs: dict[str, WriteJob] = {}
        self._busy: WriteJob | None = None
        #: Keys written / dropped since the last ``take_outcomes``.
        self._written: set[str] = set()
        self._dropped: set[str] = set()
        #: Request id -> jobs queued or being written.
        self._outstanding: Counter[str] = Counter()
        #: Finished requests whose blocks are held until their jobs are done.
        self._held: set[str] = set()
        #: Finished requests whose jobs are all done: to report in ``finished_sending``.
        self._released: set[str] = set()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- step side
    def submit(self, job: WriteJob) -> bool | None:
        """Queue ``job``; False when the queue is full (the save is dropped), None when
        the same chunk is already queued or being written (nothing to do)."""
        with self._cv:
            if job.key in self._jobs:
                return None
            if len(self._queue) >= self.max_pending or self._closed:
                self._dropped.add(job.key)
                return False
            self._queue.append(job)
            self._jobs[job.key] = job
            self._outstanding[job.req_id] += 1
            self._ensure_thread()
            self._cv.notify_all()
            return True

    def request_finished(self, req_id: str) -> None:
        """The scheduler freed ``req_id`` with a delay: release its blocks when written."""
        with self._cv:
            if self._outstanding[req_id] > 0:
                self._held.add(req_id)
            else:
                del self._outstanding[req_id]
                self._released.add(req_id)

    def write_now(self, req_ids: Iterable[str]) -> int:
        """Write the queued jobs of ``req_ids`` in the calling thread and wait until none
        of theirs is being written (preempted: vLLM is about to reuse their blocks);
        returns how many were written here."""
        ids = set(req_ids)
        if not ids:
            return 0
        with self._cv:
            mine = [job for job in self._queue if job.req_id in ids]
            self._queue = deque(job for job in self._queue if job.req_id not in ids)
            while self._busy is not None and self._busy.req_id in ids:
                self._cv.wait()
        for job in mine:
            self._run_job(job)
        return len(mine)

    def drop(self, keys: Iterable[str]) -> None:
        """Saves the step could not even queue (reported like the writer's own drops)."""
        with self._cv:
            self._dropped.update(keys)

    def job_for(self, key: str) -> WriteJob | None:
        """The job of chunk ``key`` while it is queued or being written."""
        with self._cv:
            return self._jobs.get(key)

    def take_outcomes(self) -> tuple[set[str], set[str]]:
        """Keys written and keys dropped since the last call."""
        with self._cv:
            out = (self._written, self._dropped)
            self._written, self._dropped = set(), set()
            return out

    def take_finished(self) -> set[str]:
        """Finished requests whose writes are all over (reported once each)."""
        with self._cv:
            out, self._released = self._released, set()
            return out

    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + (self._busy is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is written; False on timeout."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._queue and self._busy is None, timeout=timeout
            )

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued (up to ``timeout``), then stop the thread."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    # ------------------------------------------------------------ the thread
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvcompose-store-writer", daemon=True
            )
            self._thread.start()

    def _job_done_locked(self, job: WriteJob) -> None:
        left = self._outstanding[job.req_id] - 1
        if left > 0:
            self._outstanding[job.req_id] = left
            return
        del self._outstanding[job.req_id]
        if job.req_id in self._held:
            self._held.discard(job.req_id)
            self._released.add(job.req_id)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = job
            self._run_job(job, busy=True)

    def _run_job(self, job: WriteJob, *, busy: bool = False) -> None:
        ok = False
        try:
            ok = self._write(job)
        except Exception:  # a failed save is a future miss; the thread lives on
            logger.exception("PrefixStoreConnector: background write of %s failed", job.key)
        finally:
            with self._cv:
                if busy:
                    self._busy = None
                self._jobs.pop(job.key, None)
                (self._written if ok else self._dropped).add(job.key)
                self._job_done_locked(job)
                self._cv.notify_all()
