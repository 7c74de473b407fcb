"""The test bed's ports: outside the kernel's source-port range, and never handed out twice,
not even to another process (CI lost a decode server to a port taken between the draw and
the bind)."""

from __future__ import annotations

import subprocess
import sys

from kvcompose.testing import ports


def test_ports_are_distinct_and_below_the_ephemeral_range():
    drawn = [ports.free_port() for _ in range(50)]
    assert len(set(drawn)) == len(drawn)
    low = ports.ephemeral_range()[0]
    assert all(ports.LOWEST <= p < low for p in drawn)


def test_a_port_claimed_here_is_not_drawn_by_another_process():
    mine = ports.free_port()
    # the other process draws from a range holding only this process's port
    code = (
        "import random\n"
        "from kvcompose.testing import ports\n"
        f"random.randrange = lambda a, b: {mine}\n"
        "try:\n"
        "    print(ports.free_port())\n"
        "except RuntimeError as e:\n"
        "    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("refused"), out.stdout
