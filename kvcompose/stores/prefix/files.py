"""The store's directory: one safetensors file per chunk (and per worker), and its upkeep.

Layout: ``<path>/<key><tag>.safetensors``, where ``tag`` is empty for a single-worker
engine and ``.pp<p>tp<t>`` otherwise (each tensor/pipeline-parallel worker holds its own
slice of every layer, so each writes its own file; a chunk counts as stored when all exist).
Dot-files are writes in progress. Writes go to a temporary name and are renamed into place,
so a reader never sees a partial file. File mtimes double as the LRU clock for
``max_chunks``: every write or load sets a strictly increasing mtime.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvcompose.stores.prefix.safetensors_io import BlockRun

FILE_SUFFIX = ".safetensors"


class Occupancy(NamedTuple):
    """What a store directory holds after an eviction pass, and what the pass deleted."""

    chunks: int
    bytes: int
    evicted: int
    #: Keys of the chunks deleted (this worker's files).
    evicted_keys: tuple[str, ...] = ()


def chunk_file_name(key: str, tag: str = "") -> str:
    """The file name of one chunk as written by the worker with ``tag``."""
    return f"{key}{tag}{FILE_SUFFIX}"


def is_chunk_file(name: str) -> bool:
    """A finished chunk file (not a hidden temporary file of a write in progress)."""
    return name.endswith(FILE_SUFFIX) and not name.startswith(".")


def worker_tags(tensor_parallel: int, pipeline_parallel: int) -> list[str]:
    """The file tags of every worker of an engine; ``[""]`` for a single worker."""
    if tensor_parallel * pipeline_parallel == 1:
        return [""]
    return [f".pp{p}tp{t}" for p in range(pipeline_parallel) for t in range(tensor_parallel)]


def this_worker_tag() -> str:
    """The file tag of the calling worker process (needs vLLM's distributed groups)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    return f".pp{get_pp_group().rank_in_group}tp{get_tp_group().rank_in_group}"


def store_usage(path: str | os.PathLike[str]) -> dict[str, int]:
    """Files and bytes a store directory holds (``{"files": n, "bytes": b}``).

    Temporary files of writes in progress are not counted. A missing directory is an empty
    store.
    """
    files = 0
    nbytes = 0
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return {"files": 0, "bytes": 0}
    for entry in entries:
        if not is_chunk_file(entry.name):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        files += 1
        nbytes += st.st_size
    return {"files": files, "bytes": nbytes}


class ChunkFiles:
    """One store directory as seen by one process (scheduler or a worker).

    ``tag`` is this process's own file tag (workers write and read only their own files);
    ``all_tags`` are every worker's, which the scheduler needs to tell whether a chunk is
    stored for the whole engine.
    """

    def __init__(self, path: str, all_tags: list[str], tag: str = "") -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.all_tags = all_tags
        self.tag = tag
        self._last_touch_ns = 0

    def file(self, key: str, tag: str | None = None) -> str:
        """The path of chunk ``key`` written by the worker with ``tag`` (default: own)."""
        return os.path.join(self.path, chunk_file_name(key, self.tag if tag is None else tag))

    def stored(self, key: str) -> bool:
        """Every worker's file of chunk ``key`` exists."""
        return all(os.path.exists(self.file(key, tag)) for tag in self.all_tags)

    def stored_here(self, key: str) -> bool:
        """This worker's file of chunk ``key`` exists (a chunk already on disk is not
        rewritten)."""
        return os.path.exists(self.file(key))

    def write(
        self, key: str, tensors: dict[str, torch.Tensor | BlockRun], metadata: dict[str, str]
    ) -> int:
        """Write this worker's file of chunk ``key`` atomically; returns its size in bytes.

        Raises ``OSError`` (after removing the temporary file) when the write fails.
        """
        from kvcompose.stores.prefix.safetensors_io import write_safetensors

        final = self.file(key)
        tmp = os.path.join(self.path, f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
        try:
            write_safetensors(tmp, tensors, metadata)
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.touch(final)
        return os.path.getsize(final)

    def touch(self, path: str) -> None:
        """Set a strictly increasing mtime (file clocks are too coarse to order writes)."""
        self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1000)
        with contextlib.suppress(OSError):
            os.utime(path, ns=(self._last_touch_ns, self._last_touch_ns))

    def evict(self, max_chunks: int | None, max_bytes: int | None = None) -> Occupancy:
        """Delete the least recently written/loaded files until at most ``max_chunks``
        files and ``max_bytes`` bytes remain; returns what is left and what went.

        Writes and loads touch a request's chunks in reverse prefix order, so a chain's
        first chunks carry the newest mtimes and are the last to go.
        """
        entries = []
        for entry in os.scandir(self.path):
            if not is_chunk_file(entry.name):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, entry.path))
        entries.sort()
        files = len(entries)
        nbytes = sum(e[1] for e in entries)
        evicted = 0
        keys: list[str] = []
        for _, size, path in entries:
            over_chunks = max_chunks is not None and files > max_chunks
            over_bytes = max_bytes is not None and nbytes > max_bytes
            if not (over_chunks or over_bytes):
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            files -= 1
            nbytes -= size
            evicted += 1
            name = os.path.basename(path)[: -len(FILE_SUFFIX)]
            keys.append(name[: -len(self.tag)] if self.tag and name.endswith(self.tag) else name)
        return Occupancy(files, nbytes, evicted, tuple(keys))

    def clear(self) -> None:
        """Delete every chunk file (temporary files of writes in progress stay)."""
        for entry in list(os.scandir(self.path)):
            if is_chunk_file(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
