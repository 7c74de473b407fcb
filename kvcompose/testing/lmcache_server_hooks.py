"""``lmcache server`` with a test bed's hook: its retrieves can be held, so a fault test can
kill the server while an engine's load from it is in flight (test bed only; kvcompose ships
no patch to LMCache).

Run as ``python -m kvcompose.testing.lmcache_server_hooks <lmcache arguments>`` instead of
the ``lmcache`` console script (``LMCacheServer`` does so). With ``HOLD_DIR_ENV`` naming a
folder, the server's retrieve handler (LMCache 0.5.6:
``LMCacheDrivenTransferModule.retrieve``, the ``lmcache_driven`` mode's handler of an
engine's load) checks for ``HOLD`` in it: while that file exists, each retrieve appends its
request id to ``HELD`` and waits, answering nothing, until the file is gone. Without the
file it serves as LMCache does.
"""

from __future__ import annotations

import functools
import os
import sys
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


def main(argv: list[str] | None = None) -> None:
    folder = os.environ.get(HOLD_DIR_ENV)
    if folder:
        install(Path(folder))
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
