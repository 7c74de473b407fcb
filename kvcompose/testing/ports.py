"""Free TCP ports for the servers and engines a test bed starts.

A port asked of the kernel with ``bind(("127.0.0.1", 0))`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which is also where every outgoing connection
takes its source port. Between handing such a port out and the child binding it (an engine
binds its NIXL side channel seconds after it starts), a health check, a ZMQ socket or another
engine may take it: CI saw a decode server's ``nixl_handshake_listener`` die on "Address
already in use" and the server then never report healthy. So ports are drawn at random from
below the ephemeral range, where the kernel never hands out a source port, and each one is
claimed with a lock file held for the life of this process, so that test processes running
side by side (pytest-xdist workers) never draw the same one.
"""

from __future__ import annotations

import fcntl
import random
import socket
import tempfile
from pathlib import Path
from typing import IO

#: the lowest port drawn; below are the well-known and the commonly configured ones
LOWEST = 20000
#: the lock files that claim ports, one per port, shared by every process on the machine
CLAIMS = Path(tempfile.gettempdir()) / "kvcompose-ports"

_claimed: dict[int, IO[bytes]] = {}


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for source ports (Linux's default when it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range, and claimed
    by this process until it exits."""
    low = ephemeral_range()[0]
    if low - LOWEST < 1000:  # a machine whose ephemeral range leaves nothing below it
        return _kernel_port()
    CLAIMS.mkdir(exist_ok=True)
    for _ in range(500):
        port = random.randrange(LOWEST, low)
        if port in _claimed:
            continue
        claim = _claim(port)
        if claim is None:
            continue
        if _bindable(port):
            _claimed[port] = claim
            return port
        claim.close()
    raise RuntimeError(f"no free port found in {LOWEST}-{low - 1}")


def _claim(port: int) -> IO[bytes] | None:
    """The port's lock file, locked by this process, or None where another process holds it."""
    handle = open(CLAIMS / str(port), "ab")  # noqa: SIM115 - held until this process exits
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
