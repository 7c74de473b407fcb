"""``kvcompose.engine.nixl_poll``: the test beds' engines pause NIXL's progress thread."""

from __future__ import annotations

import importlib.util
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

#: what a process can tell without nixl: the variable, the ``sitecustomize`` it imported, and
#: the pause its finder waits to install
STATE = """
import os, sys
from kvcompose.engine import nixl_poll
site = sys.modules.get("sitecustomize")
print(os.environ.get(nixl_poll.ENV))
print(getattr(site, "__file__", None))
print([f.poll_us for f in sys.meta_path if isinstance(f, nixl_poll._BindingsFinder)])
print(os.environ.get("PYTHONPATH"))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the pause and without any ``PYTHONPATH``."""
    environ = {k: v for k, v in os.environ.items() if k not in (nixl_poll.ENV, "PYTHONPATH")}
    return {**environ, **extra}


def _child(env: dict[str, str], code: str = PROBE) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(**env), capture_output=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return proc.stdout.decode().strip().splitlines()


def test_a_child_started_with_the_environment_pauses_nixl_and_one_without_does_not():
    pytest.importorskip("nixl")
    assert _child(nixl_poll.environment(250))[-1] == "250"  # through sitecustomize, lazily
    assert _child({})[-1] == "None"


def test_the_wrapper_sets_the_pause_on_each_config_wraps_once_and_takes_the_latest():
    made = []
    bindings = SimpleNamespace(nixlAgent=lambda name, config: made.append((name, config)))
    nixl_poll._patch(bindings, 1000)
    wrapper = bindings.nixlAgent
    config = SimpleNamespace(pthrDelay=0)
    bindings.nixlAgent("a", config)
    assert made == [("a", config)] and config.pthrDelay == 1000
    nixl_poll._patch(bindings, 5)  # a second install keeps the wrapper, with its pause
    again = SimpleNamespace(pthrDelay=0)
    bindings.nixlAgent("b", again)
    assert bindings.nixlAgent is wrapper and made[-1] == ("b", again) and again.pthrDelay == 5


def test_the_environment_puts_the_site_directory_first_and_keeps_the_rest():
    env = nixl_poll.environment(7, base={"PYTHONPATH": f"/x{os.pathsep}/y"})
    site, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert env[nixl_poll.ENV] == "7" and rest == ["/x", "/y"]
    assert (Path(site) / "sitecustomize.py").read_text() == nixl_poll._SITE
    twice = nixl_poll.environment(7, base=env)  # applied again: the directory stays once
    assert twice == env


def test_the_shell_lines_give_a_python_started_after_them_the_pause(tmp_path: Path):
    """``eval "$(python -m kvcompose.engine.nixl_poll)"``, as docs/pd.md runs it (twice, as a
    reader running both servers' commands in one shell would), keeps the shell's own
    ``PYTHONPATH`` entries (one with a space) and gives a Python started afterwards the
    variable, our ``sitecustomize`` and its finder."""
    kept = tmp_path / "a dir"
    kept.mkdir()
    script = (
        'eval "$("$PY" -m kvcompose.engine.nixl_poll)"\n'
        'eval "$("$PY" -m kvcompose.engine.nixl_poll)"\n'
        '"$PY" -c "$STATE"\n'
    )
    proc = subprocess.run(
        ["bash", "-c", script],
        env=_clean_env(PY=sys.executable, STATE=STATE, PYTHONPATH=str(kept)),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    value, site, finders, path = proc.stdout.decode().strip().splitlines()[-4:]
    site_dir = nixl_poll.environment()["PYTHONPATH"].split(os.pathsep)[0]
    assert value == str(nixl_poll.DEFAULT_US)
    assert Path(site) == Path(site_dir) / "sitecustomize.py"
    assert finders == f"[{nixl_poll.DEFAULT_US}]"
    assert path.split(os.pathsep) == [site_dir, str(kept)]


def test_the_shell_lines_take_another_pause():
    out = subprocess.run(
        [sys.executable, "-m", "kvcompose.engine.nixl_poll", "250"],
        env=_clean_env(),
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    assert f"export {nixl_poll.ENV}=250\n" in out and "export PYTHONPATH=" in out


def test_the_site_module_lets_a_python_without_kvcompose_start(tmp_path: Path):
    """The exported ``PYTHONPATH`` reaches every Python the shell starts; one that cannot
    import kvcompose starts without the pause and without an error."""
    site = Path(nixl_poll.environment()["PYTHONPATH"].split(os.pathsep)[0]) / "sitecustomize.py"
    code = f"import runpy; runpy.run_path({str(site)!r}); print('started')"
    # -S -E: no site-packages and no PYTHONPATH, so kvcompose cannot be imported
    proc = subprocess.run(
        [sys.executable, "-S", "-E", "-c", code], capture_output=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout.decode().strip() == "started"


def test_an_engine_child_installs_the_pause_its_env_gives():
    """``EngineProcess``'s child starts with its parent's environment and applies its own
    only once running (``process._apply_env``): the pause in that env must be installed
    there, also over one a ``sitecustomize`` installed at start-up. The child here is a
    plain Python running what the engine child runs before building vLLM."""
    apply = (
        "from kvcompose.engine import nixl_poll, process\n"
        "process._apply_env({nixl_poll.ENV: '250'})\n"
    )
    finders = "print([f.poll_us for f in sys.meta_path if type(f).__name__ == '_BindingsFinder'])"
    assert _child({}, f"import sys\n{apply}{finders}") == ["[250]"]
    started_with = nixl_poll.environment(1000)  # a sitecustomize installed 1000 first
    assert _child(started_with, f"import sys\n{apply}{finders}") == ["[250]"]
    if importlib.util.find_spec("nixl") is not None:
        assert _child({}, apply + PROBE)[-1] == "250"
        assert _child(started_with, apply + PROBE)[-1] == "250"
