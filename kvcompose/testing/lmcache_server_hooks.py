"""``lmcache server`` with a test bed's hooks: its retrieves can be held, so a fault test can
kill the server while an engine's load from it is in flight, and its writes are counted, so
a test can wait until what an engine stored is visible (test bed only; kvcompose ships no
patch to LMCache).

Run as ``python -m kvcompose.testing.lmcache_server_hooks <lmcache arguments>`` instead of
the ``lmcache`` console script (``LMCacheServer`` does so). With ``HOLD_DIR_ENV`` naming a
folder:

- the server's retrieve handler (LMCache 0.5.6: ``LMCacheDrivenTransferModule.retrieve``,
  the ``lmcache_driven`` mode's handler of an engine's load) checks for ``HOLD`` in it: while
  that file exists, each retrieve appends its request id to ``HELD`` and waits, answering
  nothing, until the file is gone. Without the file it serves as LMCache does;
- ``WRITES`` holds two counts of chunks: those a store copied and handed to the commit
  (``StorageManager.prepare_write_completion``) and those committed
  (``StorageManager.finish_write_by_owner``). The server acknowledges a store before the
  commit, which runs later on its dispatcher thread, and a lookup finds committed chunks
  only: a lookup right after an engine's store finished can miss what it stored.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: The environment variable naming the hook's folder (unset: no hook).
HOLD_DIR_ENV = "KVCOMPOSE_LMCACHE_HOLD_DIR"
#: While this file exists in the folder, retrieves wait.
HOLD = "hold"
#: One line per retrieve that waited: its request id.
HELD = "held"
#: The longest a retrieve waits (seconds): a forgotten hold ends.
MAX_HOLD_S = 600.0
#: "<handed to the commit> <committed>": chunks, since the server started.
WRITES = "writes"


def install(folder: Path) -> None:
    """Wrap ``LMCacheDrivenTransferModule.retrieve`` (before the server builds its
    modules): ``functools.wraps`` keeps the ``request_handler`` options and the signature
    LMCache's ``validate_handler`` checks."""
    from lmcache.v1.multiprocess.modules.lmcache_driven_transfer import (
        LMCacheDrivenTransferModule as Module,
    )

    original = Module.retrieve

    @functools.wraps(original)
    def retrieve(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
        hold = folder / HOLD
        if hold.exists():
            with open(folder / HELD, "a") as out:
                out.write(f"{getattr(key, 'request_id', key)}\n")
            deadline = time.monotonic() + MAX_HOLD_S
            while hold.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return original(self, key, *args, **kwargs)

    Module.retrieve = retrieve  # type: ignore[method-assign]
    _count_writes(folder)


def _count_writes(folder: Path) -> None:
    """Wrap the two ``StorageManager`` steps of a store's commit (before the server binds
    ``finish_write_by_owner`` to its dispatcher) to keep ``WRITES`` current."""
    from lmcache.v1.distributed.storage_manager import StorageManager

    lock = threading.Lock()
    counts = {"handed": 0, "committed": 0}

    def add(field: str, chunks: int) -> None:
        with lock:
            counts[field] += chunks
            part = folder / f"{WRITES}.part"
            part.write_text(f"{counts['handed']} {counts['committed']}\n")
            part.replace(folder / WRITES)

    prepare = StorageManager.prepare_write_completion
    finish = StorageManager.finish_write_by_owner

    @functools.wraps(prepare)
    def prepare_write_completion(self: Any, objects: Any) -> Any:
        completion = prepare(self, objects)
        add("handed", sum(len(keys) for _, keys in completion))
        return completion

    @functools.wraps(finish)
    def finish_write_by_owner(self: Any, completion: Any) -> None:
        try:
            finish(self, completion)
        finally:
            add("committed", sum(len(keys) for _, keys in completion))

    StorageManager.prepare_write_completion = prepare_write_completion  # type: ignore[method-assign]
    StorageManager.finish_write_by_owner = finish_write_by_owner  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    folder = os.environ.get(HOLD_DIR_ENV)
    if folder:
        install(Path(folder))
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
