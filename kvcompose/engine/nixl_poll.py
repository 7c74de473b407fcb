"""NIXL's progress thread pausing between polls, for engines sharing a few CPU cores.

nixl's Python agent (``nixl_agent.__init__``) starts its progress thread with
``pthrDelay = 0``: it polls UCX without a pause, a whole core per engine from the agent's
creation on, busy or idle, and vLLM's ``NixlConnectorWorker`` has no setting for it. On a
2-core machine running two to four engines those threads take the cores from the engines:
a first NIXL read took 20.7 s (vLLM's ``nixl.Avg xfer time``) and D's side-channel handshake
missed its 5 s (``NixlConnectorWorker._nixl_handshake``). With ``KVCOMPOSE_NIXL_POLL_US``
set, every NIXL agent created later pauses that many microseconds between polls (measured
on 2 cores with 1,000: 3 % of a core while idle instead of 100 %; a 4 MiB read between two
agents in 1-5 ms, as without the pause).

The setting is a test bed's, never a default: it changes a NIXL internal that vLLM does not
expose. :func:`environment` gives what a child process needs: vLLM spawns its workers on
CPU (``CpuPlatform.check_and_update_config``), so the hook reaches them through a
``sitecustomize`` module on ``PYTHONPATH``, and the processes they start inherit both. It
hides any other ``sitecustomize`` from those processes (the project's environments have none);
a process started with another one first (``EngineProcess``'s children, which apply their
environment only once running) calls :func:`install_from_env` itself.

``python -m kvcompose.engine.nixl_poll [US]`` prints the same variables as shell ``export``
lines (default: the beds' 1 ms), for servers started by hand on a few cores:
``eval "$(python -m kvcompose.engine.nixl_poll)"``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import os
import shlex
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "KVCOMPOSE_NIXL_POLL_US"
#: what the test beds use: a thousand wake-ups a second cost about 3 % of a core
DEFAULT_US = 1000
#: the ``sitecustomize``; a Python without kvcompose (another environment started from a shell
#: that exported the variables) starts as if it were not there
_SITE = """try:
    from kvcompose.engine.nixl_poll import install_from_env
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "kvcompose":
        raise
else:
    install_from_env()
"""


def environment(poll_us: int = DEFAULT_US, base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that make a child process (and those it starts) pause NIXL's polls:
    ``KVCOMPOSE_NIXL_POLL_US`` and ``PYTHONPATH`` with the ``sitecustomize`` directory
    first (``base``: the environment whose ``PYTHONPATH`` is extended; this process's)."""
    base = os.environ if base is None else base
    site = str(_site_dir())
    rest = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    return {ENV: str(poll_us), "PYTHONPATH": os.pathsep.join([site, *rest])}


def shell_exports(poll_us: int = DEFAULT_US, base: dict[str, str] | None = None) -> str:
    """:func:`environment` as POSIX shell ``export`` lines, for ``eval``."""
    env = environment(poll_us, base)
    return "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())


def install_from_env() -> None:
    """:func:`install` with ``KVCOMPOSE_NIXL_POLL_US`` microseconds, if it is set."""
    text = os.environ.get(ENV, "").strip()
    if text:
        install(int(text))


def install(poll_us: int) -> None:
    """Make every NIXL agent created from now on in this process pause ``poll_us`` µs
    between its progress thread's polls: at once if nixl's bindings are loaded, else when
    they are. A later call's pause replaces an earlier one's (a process whose
    ``sitecustomize`` installed one, then given another environment)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _BindingsFinder)]
    for name, module in list(sys.modules.items()):
        if _is_bindings(name):
            _patch(module, poll_us)
            return
    sys.meta_path.insert(0, _BindingsFinder(poll_us))


def _is_bindings(name: str) -> bool:
    """``nixl_cu12._bindings`` and its siblings (``nixl._bindings`` is an alias of one)."""
    package, _, leaf = name.rpartition(".")
    return leaf == "_bindings" and package.startswith("nixl_")


def _patch(bindings: ModuleType, poll_us: int) -> None:
    """Wrap ``nixlAgent`` (nixl's ``_api`` looks it up on the bindings at each agent's
    creation) so the config it is given pauses ``poll_us`` between polls; wrapped once, a
    second patch only changes the pause."""
    current = bindings.nixlAgent
    if getattr(current, "_kvcompose_poll_us", None) is not None:
        current._kvcompose_poll_us = poll_us
        return
    make = current

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = agent._kvcompose_poll_us  # type: ignore[attr-defined]
        return make(name, config)

    agent._kvcompose_poll_us = poll_us  # type: ignore[attr-defined]
    bindings.nixlAgent = agent


class _BindingsFinder(importlib.abc.MetaPathFinder):
    """Patches nixl's bindings once they are loaded, then steps out of the import path."""

    def __init__(self, poll_us: int) -> None:
        self.poll_us = poll_us

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not _is_bindings(name):
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        poll_us = self.poll_us

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module, poll_us)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _site_dir() -> Path:
    """A directory holding only the ``sitecustomize`` that calls :func:`install_from_env`
    (written once per user; replaced atomically, so parallel test workers never see half)."""
    directory = Path(tempfile.gettempdir()) / f"kvcompose-nixl-poll-{os.getuid()}"
    site = directory / "sitecustomize.py"
    if not site.is_file() or site.read_text() != _SITE:
        directory.mkdir(exist_ok=True)
        partial = directory / f".sitecustomize.{os.getpid()}"
        partial.write_text(_SITE)
        partial.replace(site)
    return directory


def main(argv: list[str] | None = None) -> None:
    """Print the ``export`` lines of :func:`shell_exports` (``PYTHONPATH`` extended from this
    process's, so the shell's own entries stay)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcompose.engine.nixl_poll",
        description="Shell export lines that make NIXL's progress threads pause between "
        "polls (for engines sharing a few CPU cores): "
        'eval "$(python -m kvcompose.engine.nixl_poll)"',
    )
    parser.add_argument(
        "poll_us",
        nargs="?",
        type=int,
        default=DEFAULT_US,
        help=f"microseconds between polls (default {DEFAULT_US})",
    )
    sys.stdout.write(shell_exports(parser.parse_args(argv).poll_us))


if __name__ == "__main__":
    main()
