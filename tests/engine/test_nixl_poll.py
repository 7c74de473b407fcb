"""``kvcompose.engine.nixl_poll``: the test beds' engines pause NIXL's progress thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcompose.engine import nixl_poll

#: a child's view: the poll pause wrapped around nixl's agent constructor, once an agent exists
PROBE = """
import sys
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
print(getattr(sys.modules["nixl._bindings"].nixlAgent, "_kvcompose_poll_us", None))
"""


def _child(env: dict[str, str]) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in (nixl_poll.ENV, "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env={**environ, **env}, capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout.decode().strip().splitlines()[-1]


def test_a_child_started_with_the_environment_pauses_nixl_and_one_without_does_not():
    pytest.importorskip("nixl")
    assert _child(nixl_poll.environment(250)) == "250"  # through sitecustomize, lazily
    assert _child({}) == "None"


def test_the_wrapper_sets_the_pause_on_each_config_and_wraps_once():
    made = []
    bindings = SimpleNamespace(nixlAgent=lambda name, config: made.append((name, config)))
    nixl_poll._patch(bindings, 1000)
    nixl_poll._patch(bindings, 5)  # a second install keeps the first wrapper
    config = SimpleNamespace(pthrDelay=0)
    bindings.nixlAgent("a", config)
    assert made == [("a", config)] and config.pthrDelay == 1000


def test_the_environment_puts_the_site_directory_first_and_keeps_the_rest():
    env = nixl_poll.environment(7, base={"PYTHONPATH": f"/x{os.pathsep}/y"})
    site, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert env[nixl_poll.ENV] == "7" and rest == ["/x", "/y"]
    assert (Path(site) / "sitecustomize.py").read_text() == nixl_poll._SITE
