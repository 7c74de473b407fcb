"""The LMCache test bed's own parts that need no server: the dispatcher workaround, the
removal of shared-memory segments left behind and the segments only the server still maps
(``kvcompose.testing.lmcache_*``)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvcompose.testing import lmcache_dispatcher
from kvcompose.testing.lmcache_server import SHM, LMCacheServer, kvcompose_root


class _LibFnWrapper:
    """Like numba's ``llvmlite.binding.ffi._lib_fn_wrapper``: attribute reads are forwarded,
    so ``vars()`` of it is no dict (here: a string)."""

    __slots__ = ()

    def __getattr__(self, name: str) -> str:
        return f"forwarded {name}"


def kernel() -> None: ...


def wrapper() -> None: ...


class _Owner:
    """A JIT warmup owner: holds the kernel as an instance attribute."""

    def __init__(self) -> None:
        self.kernel = kernel
        self._kernel_arg_names = ("x",)


@pytest.fixture
def module() -> types.ModuleType:
    mod = types.ModuleType("kvcompose_test_kernels")
    mod.copied = kernel
    mod.owner = _Owner()
    mod.odd = _LibFnWrapper()
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_rebind_kernels_skips_values_whose_vars_is_no_dict(module) -> None:
    lmcache_dispatcher.rebind_kernels([(kernel, wrapper)])
    assert module.copied is wrapper
    assert module.owner.kernel is wrapper
    assert "_kernel_arg_names" not in vars(module.owner)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_s_own_rebind_kernels_fails_on_them(module) -> None:
    """The workaround is needed: vLLM's function dies on such a value."""
    from vllm.triton_utils import dispatcher

    with pytest.raises(AttributeError, match="has no attribute 'get'"):
        dispatcher._rebind_kernels([(kernel, wrapper)])


def test_sitecustomize_patches_the_dispatcher_when_vllm_imports_it(tmp_path: Path) -> None:
    """A process started with the bed's site folder first on ``PYTHONPATH`` imports the
    dispatcher with ``_rebind_kernels`` replaced (a stand-in module, so no vLLM is needed)."""
    fake = tmp_path / "fake" / "vllm" / "triton_utils"
    fake.mkdir(parents=True)
    for init in (fake.parent / "__init__.py", fake / "__init__.py"):
        init.write_text("")
    (fake / "dispatcher.py").write_text("def _rebind_kernels(overrides):\n    raise ValueError\n")
    site = lmcache_dispatcher.site_dir(tmp_path / "site")
    code = (
        "from vllm.triton_utils import dispatcher\n"
        "from kvcompose.testing.lmcache_dispatcher import rebind_kernels\n"
        "assert dispatcher._rebind_kernels is rebind_kernels\n"
    )
    paths = [str(site), kvcompose_root(), str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_stop_removes_segments_left_behind_and_only_those(tmp_path: Path) -> None:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    bed = LMCacheServer(tmp_path)  # never started: only its segment bookkeeping
    before = SHM / f"lmcache_kv_test_{os.getpid()}_before"
    left = SHM / f"lmcache_kv_test_{os.getpid()}_left"
    held = SHM / f"lmcache_kv_test_{os.getpid()}_held"
    before.write_bytes(b"x")
    try:
        bed._shm_before = {before.name}
        left.write_bytes(b"x")
        held.write_bytes(b"x")
        with open(held, "r+b") as fh:
            import mmap

            with mmap.mmap(fh.fileno(), 1):  # a live mapping: not left behind
                bed.stop()
                assert held.exists()
        assert not left.exists()
        assert before.exists()
    finally:
        for path in (before, left, held):
            path.unlink(missing_ok=True)


#: A stand-in for a process that maps shared-memory segments as LMCache's server and engines
#: do (an ``mmap`` of the ``/dev/shm`` file, kept): it maps the segments named before
#: ``--child``, starts a child of its own (same process group) mapping those after it, says
#: so, and sleeps.
MAPPER = """
import mmap, subprocess, sys, time
args = sys.argv[1:]
names, rest = (args[:args.index("--child")], args[args.index("--child") + 1:]) \\
    if "--child" in args else (args, [])
maps = []
for name in names:
    with open("/dev/shm/" + name, "r+b") as fh:
        maps.append(mmap.mmap(fh.fileno(), 1))
if rest:
    kid = subprocess.Popen([sys.executable, "-c", CODE, *rest],
                           stdout=subprocess.PIPE, text=True)
    assert kid.stdout.readline() == "mapped\\n"
print("mapped", flush=True)
time.sleep(600)
"""


def _mapper(*args: str, own_group: bool = False) -> subprocess.Popen[str]:
    """A ``MAPPER`` process, once it maps its segments (``own_group``: a group of its own, as
    ``LMCacheServer.start`` starts the server)."""
    code = f"CODE = {MAPPER!r}\n{MAPPER}"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "mapped\n"
    return proc


def test_orphaned_segments_are_those_only_the_server_still_maps(tmp_path: Path) -> None:
    """A stand-in server maps the segment of an engine that ended and that of a live
    engine; a child of the server maps a third one the live engine maps too; a
    fourth nobody maps (``clear_shm``'s business, not an orphan). Only the first is orphaned
    until the live engine ends; then all three are, also one unlinked while the server maps
    it; a server that is down holds none."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    tag = f"lmcache_kv_test_{os.getpid()}"
    dead, live, child, unmapped = (SHM / f"{tag}_{n}" for n in ("dead", "live", "child", "none"))
    for path in (dead, live, child, unmapped):
        path.write_bytes(b"x")
    bed = LMCacheServer(tmp_path)  # never started: only its segment bookkeeping
    procs: list[subprocess.Popen[str]] = []
    try:
        assert bed.orphaned_segments() == []  # no server
        procs.append(_mapper(dead.name, live.name, "--child", child.name, own_group=True))
        procs.append(_mapper(live.name, child.name))  # the live engine
        bed.proc = procs[0]  # type: ignore[assignment]
        assert bed.orphaned_segments() == [dead.name]

        procs[1].kill()
        procs[1].wait(10)
        assert bed.orphaned_segments() == sorted([dead.name, live.name, child.name])
        assert unmapped.name not in bed.orphaned_segments()
        dead.unlink()  # as an engine's exit unlinks it: the server's mapping still holds it
        assert dead.name in bed.orphaned_segments()

        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        assert bed.orphaned_segments() == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                if proc is procs[0]:
                    os.killpg(proc.pid, signal.SIGKILL)  # the server and its child
                else:
                    proc.kill()
                proc.wait(10)
        bed.proc = None
        for path in (dead, live, child, unmapped):
            path.unlink(missing_ok=True)


#: the pid of the stand-in ``forkserver`` (``None``: none runs)
_FORKSERVER: list[int | None] = [None]


class _Recorded:
    """Stands in for ``EngineProcess``: records how ``LMCacheServer.engine`` builds it; a
    preloaded one starts the stand-in ``forkserver`` if none runs, as the real one does."""

    def __init__(self, model_dir: object, config: object, **kw: object) -> None:
        self.kw = kw
        self.environ = dict(os.environ)
        if kw["preloaded"] and _FORKSERVER[0] is None:
            _FORKSERVER[0] = 4242

    def close(self, graceful: bool = True) -> None: ...


def test_engines_fork_only_from_a_preload_server_the_bed_started(monkeypatch, tmp_path) -> None:
    """An LMCache engine forks from the preloaded ``forkserver`` when none runs yet (it then
    starts in the engine's environment, the dispatcher workaround on its ``PYTHONPATH``) or
    the bed started it; from one something else started, it is spawned."""
    from kvcompose.testing import lmcache_server

    monkeypatch.setattr(lmcache_server, "_LMCACHE_PRELOAD_SERVERS", set())
    monkeypatch.setattr(lmcache_server, "preload_server_pid", lambda: _FORKSERVER[0])
    _FORKSERVER[0] = None
    server = LMCacheServer(tmp_path)
    first = server.engine("first", tmp_path, None, engine_class=_Recorded)
    assert first.kw["preloaded"] is True
    assert str(server.site) in first.environ["PYTHONPATH"].split(os.pathsep)
    assert server.engine("again", tmp_path, None, engine_class=_Recorded).kw["preloaded"] is True
    _FORKSERVER[0] = 5151  # it died; another was started by something else
    assert server.engine("other", tmp_path, None, engine_class=_Recorded).kw["preloaded"] is False
    server.stop()
