"""A shared Mooncake Store tier for tests with several real engines at once.

``MooncakeCluster`` starts ``mooncake_master`` (with its built-in HTTP metadata server, so no
etcd) and one ``mooncake_client`` "pool" that owns the memory segment, so stored KV outlives
the engines that wrote it. Everything listens on 127.0.0.1, on free ports. It writes the
JSON file that vLLM's ``MooncakeStoreConnector`` reads through ``MOONCAKE_CONFIG_PATH``
(``protocol: tcp``, ``mode: standalone-store``, small sizes: the defaults are RDMA and 4 GiB
buffers), and starts engines as ``EngineProcess`` children, each with its own lookup socket
(``lookup_rpc_port`` and ``VLLM_RPC_BASE_PATH``) so that several run side by side.

The wheel (``mooncake-transfer-engine-non-cuda``, the ``mooncake`` extra) links
``libibverbs.so.1``, which these machines lack. nixl-cu12 bundles a copy under a renamed
file; ``make_ibverbs_shim`` makes a folder of symlinks to it (and to the two libnl libraries
it needs, since ``$ORIGIN`` resolves to the link's folder), and every process this module
starts gets that folder on ``LD_LIBRARY_PATH``. The dynamic loader reads that variable when a
process starts, so it is set in the environment a child is started with, never later.
``scripts/setup.sh`` makes the folder (``python -m kvcompose.testing.mooncake --shim``).

See docs/shared-tier.md.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcompose.engine.process import EngineProcess
from kvcompose.testing.ports import free_port

#: The bundled libraries the shim links to: (pattern in nixl_cu12.libs, extra link name).
_SHIM_LIBS = (
    ("libibverbs-*.so.*", "libibverbs.so.1"),
    ("libnl-3-*.so.*", None),
    ("libnl-route-3-*.so.*", None),
)
#: Where the shim lives: inside the environment, next to the libraries it points at.
SHIM_DIR_NAME = "kvcompose-ibverbs"

#: The connector's class name in vLLM (no module path needed: vLLM's factory knows it).
CONNECTOR = "MooncakeStoreConnector"
#: How long a master's admin page may take to answer: seconds, on a 2-core machine whose
#: other core runs a CPU-bound test session (seen: over 5 s for the key listing).
ADMIN_TIMEOUT_S = 30.0


def shim_dir(prefix: str | os.PathLike[str] | None = None) -> Path:
    """The shim folder of the environment at ``prefix`` (default: this interpreter's)."""
    return Path(prefix or sys.prefix) / "lib" / SHIM_DIR_NAME


def _nixl_libs() -> Path | None:
    spec = importlib.util.find_spec("nixl_cu12")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "nixl_cu12.libs"
    return libs if libs.is_dir() else None


def make_ibverbs_shim(target: str | os.PathLike[str] | None = None) -> Path:
    """Make (or refresh) the folder of symlinks to nixl-cu12's bundled libibverbs and libnl;
    returns it. Raises ``FileNotFoundError`` when nixl-cu12 or one of the libraries is
    missing."""
    libs = _nixl_libs()
    if libs is None:
        raise FileNotFoundError("nixl-cu12 is not installed (its nixl_cu12.libs folder is gone)")
    folder = Path(target) if target is not None else shim_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for pattern, alias in _SHIM_LIBS:
        found = sorted(libs.glob(pattern))
        if not found:
            raise FileNotFoundError(f"no {pattern} in {libs}")
        for name in {found[0].name, alias} - {None}:
            link = folder / str(name)
            if link.is_symlink() or link.exists():
                if link.resolve() == found[0].resolve():
                    continue
                link.unlink()
            link.symlink_to(os.path.relpath(found[0], folder))
    return folder


def mooncake_missing() -> str | None:
    """Why Mooncake Store cannot run in this environment (``None``: it can)."""
    if importlib.util.find_spec("mooncake") is None:
        return "the mooncake extra is not installed (mooncake-transfer-engine-non-cuda)"
    if _nixl_libs() is None and not _system_ibverbs():
        return "libibverbs.so.1 is missing and nixl-cu12 (which bundles it) is not installed"
    return None


def _system_ibverbs() -> bool:
    import ctypes.util

    return ctypes.util.find_library("ibverbs") is not None


def mooncake_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: a copy of ``os.environ``) with the shim first on
    ``LD_LIBRARY_PATH`` (made here if setup.sh has not made it)."""
    out = dict(os.environ if env is None else env)
    if _nixl_libs() is None:
        return out  # a system libibverbs, if any, is all there is
    folder = shim_dir()
    if not (folder / "libibverbs.so.1").exists():
        folder = make_ibverbs_shim(folder)
    parts = [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    if str(folder) not in parts:
        out["LD_LIBRARY_PATH"] = os.pathsep.join([str(folder), *parts])
    return out


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` set to ``env`` while a child is spawned (it inherits it at exec)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _bin(name: str) -> str:
    """The console script of the wheel in this interpreter's environment."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


class MooncakeError(RuntimeError):
    """A Mooncake process failed to start or answer; the message ends with its log."""


class _Server:
    """One Mooncake process in a process group of its own, its output in ``log``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


class MooncakeCluster:
    """A master (with its HTTP metadata server) and one pool client, on free ports.

    ``start()`` / ``stop()``, or use it as a context manager. ``config_path``: the file to
    give engines as ``MOONCAKE_CONFIG_PATH``. ``engine(...)`` starts an ``EngineProcess`` set
    up for it; ``stop()`` ends every engine and server it started. ``kill_master()`` /
    ``start_master()`` for fault tests (same ports, so clients reconnect); ``clear()``
    removes every stored object; ``keys()`` lists them.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        pool_size: str = "256 MB",
        local_buffer_size: str = "64 MB",
        lease_ttl_ms: int = 1000,
        start_timeout: float = 60.0,
    ) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvcompose-mooncake-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pool_size = pool_size
        self.start_timeout = start_timeout
        self.env = mooncake_env()
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.admin_port = free_port()
        self.pool_port = free_port()
        self.metadata_url = f"http://127.0.0.1:{self.metadata_port}/metadata"
        self.master_address = f"127.0.0.1:{self.rpc_port}"
        self.config: dict[str, Any] = {
            "metadata_server": self.metadata_url,
            "master_server_address": self.master_address,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": local_buffer_size,
        }
        self.config_path = self.workdir / "mooncake.json"
        self.config_path.write_text(json.dumps(self.config, indent=1))
        self._master_starts = 0
        self.master = _Server(
            "mooncake_master",
            [
                _bin("mooncake_master"),
                f"-rpc_port={self.rpc_port}",
                "-rpc_address=127.0.0.1",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.metadata_port}",
                f"-metrics_port={self.admin_port}",
                f"-default_kv_lease_ttl={lease_ttl_ms}",
            ],
            self.env,
            self.workdir / "master.log",
        )
        self.pool = _Server(
            "mooncake_client",
            [
                _bin("mooncake_client"),
                "-host=127.0.0.1",
                f"-port={self.pool_port}",
                f"-global_segment_size={pool_size}",
                "-protocol=tcp",
                f"-master_server_address={self.master_address}",
                f"-metadata_server={self.metadata_url}",
            ],
            self.env,
            self.workdir / "pool.log",
        )
        self._engines: list[EngineProcess] = []
        self._next_lookup_port = 0

    # ------------------------------------------------------------------ servers

    def start(self) -> MooncakeCluster:
        atexit.register(self.stop)  # also when the caller never reaches its own stop()
        try:
            self.start_master()
            self.pool.start()
            self._wait(self.pool, [self.pool_port])
            self.wait_pool_mounted()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start the master (again, on the same ports) and wait until it serves."""
        self.master.start()
        self._master_starts += 1
        self._wait(self.master, [self.rpc_port, self.metadata_port, self.admin_port])

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would: its metadata (every key) is lost."""
        self.master.stop(signal.SIGKILL)

    def wait_pool_mounted(self, timeout: float | None = None) -> None:
        """Wait until the master lists the pool's segment (after a start or a master
        restart: the pool re-mounts on its own once its pings reach the master)."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self._admin("get_all_segments").strip():
                    return
            if not self.pool.alive():
                raise MooncakeError(f"mooncake_client exited:\n{self.pool.tail()}")
            time.sleep(0.2)
        raise MooncakeError(f"the pool's segment was not mounted:\n{self.pool.tail()}")

    def _wait(self, server: _Server, ports: list[int]) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not all(_port_open(p) for p in ports):
            if not server.alive():
                raise MooncakeError(f"{server.name} exited at start-up:\n{server.tail()}")
            if time.monotonic() > deadline:
                raise MooncakeError(f"{server.name} did not listen on {ports}:\n{server.tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """End every engine, then the pool and the master (each by its own pid); again
        is a no-op."""
        atexit.unregister(self.stop)
        engines, self._engines = self._engines, []
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.close(graceful=False)
        self.pool.stop()
        self.master.stop()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the store

    def _admin_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin_port}/{path}"

    def _admin(self, path: str, timeout: float = ADMIN_TIMEOUT_S) -> str:
        with urllib.request.urlopen(self._admin_url(path), timeout=timeout) as r:
            return r.read().decode()

    @property
    def keys_url(self) -> str:
        """The master's key listing (its admin ``/get_all_keys``: one key a line)."""
        return self._admin_url("get_all_keys")

    def keys(self) -> list[str]:
        """Every key the master holds (its admin ``/get_all_keys``)."""
        return listed_keys(self.keys_url)

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus metrics (``/metrics``), summed over labels."""
        out: dict[str, float] = {}
        for line in self._admin("metrics").splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def clear(self, timeout: float = 60.0) -> int:
        """Remove every stored object; returns how many were removed. ``remove_all`` runs
        with no segment of its own, and is repeated until the master lists no key: an object
        read within its lease (``lease_ttl_ms``) is kept by the master until the lease ends."""
        body = (
            f"deadline = time.monotonic() + {timeout}\n"
            "removed = 0\n"
            "while True:\n"
            "    n = s.remove_all()\n"
            "    if n < 0: sys.exit(f'remove_all returned {n}')\n"
            "    removed += n\n"
            "    if not urllib.request.urlopen(url, timeout=5).read().strip(): break\n"
            "    if time.monotonic() > deadline: sys.exit('keys left after the deadline')\n"
            "    time.sleep(0.2)\n"
            "print('removed', removed)\n"
        )
        return self._store_script("removed", body, 1 << 20, timeout + 30)

    def corrupt(self, timeout: float = 60.0) -> int:
        """Overwrite every stored object with noise of its size (a negative control: an
        engine that loads them must then produce different output); returns how many.

        The noise is finite float32 values (normal, scale 4), not raw random bytes. With raw
        bytes (which hold NaNs) the next test on the same engine failed: a request whose
        prompt KV loaded intact decoded its first token right and then only token 0. The
        likely cause is NaNs left in the freed KV blocks, read again through a reused
        block's unused slots. With finite noise every later request matched.
        """
        body = (
            "import numpy as np\n"
            "rng = np.random.default_rng(0)\n"
            "keys = urllib.request.urlopen(url, timeout=5).read().decode().split()\n"
            "for key in keys:\n"
            "    size = s.get_size(key)\n"
            "    noise = (rng.standard_normal(size // 4, dtype=np.float32) * 4).tobytes()\n"
            "    if size <= 0 or s.upsert(key, noise) != 0: sys.exit(f'{key}: {size}')\n"
            "print('corrupted', len(keys))\n"
        )
        return self._store_script("corrupted", body, 16 << 20, timeout)

    def _store_script(self, done: str, body: str, segment_bytes: int, timeout: float) -> int:
        """Run ``body`` in a child process (the store client needs the libibverbs shim at
        start) with ``s``, a store client of the cluster, and ``url``, the master's key
        listing; it prints ``<done> N``, and N is returned."""
        code = (
            "import sys, time, urllib.request\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"rc = s.setup('127.0.0.1', {self.metadata_url!r}, 0, {segment_bytes}, 'tcp', '', "
            f"{self.master_address!r})\n"
            "if rc != 0: sys.exit(f'setup failed: {rc}')\n"
            f"url = {self.keys_url!r}\n"
        ) + body
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(f"{done} ")]
        if out.returncode != 0 or not lines:
            raise MooncakeError(f"{done}: failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return int(lines[-1].split()[1])

    # ------------------------------------------------------------------ engines

    def lookup_rpc_port(self) -> int:
        """A ``lookup_rpc_port`` no other engine of this cluster uses."""
        self._next_lookup_port += 1
        return self._next_lookup_port

    def leaf(self, name: str = "shared", **extra_config: Any) -> dict[str, Any]:
        """A kvcompose leaf running vLLM's ``MooncakeStoreConnector`` with its own
        ``lookup_rpc_port`` (node fields such as ``on_error`` go in ``fields=``)."""
        fields = extra_config.pop("fields", {})
        extra = {"lookup_rpc_port": self.lookup_rpc_port(), **extra_config}
        return {"kind": "leaf", "name": name, "connector": CONNECTOR, "extra_config": extra,
                **fields}  # fmt: skip

    def connector_config(self, **extra_config: Any) -> dict[str, Any]:
        """The plain ``KVTransferConfig`` dict of a ``MooncakeStoreConnector`` engine."""
        return {
            "kv_connector": CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lookup_rpc_port": self.lookup_rpc_port(),
                **extra_config,
            },
        }

    def engine_env(self, name: str) -> dict[str, str]:
        """What an engine process needs: the config file, and a lookup-socket folder of its
        own (a second guard besides ``lookup_rpc_port``)."""
        rpc_dir = self.workdir / "rpc" / name
        rpc_dir.mkdir(parents=True, exist_ok=True)
        return {"MOONCAKE_CONFIG_PATH": str(self.config_path), "VLLM_RPC_BASE_PATH": str(rpc_dir)}

    def engine(
        self,
        name: str,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None,
        *,
        env: dict[str, str] | None = None,
        **kw: Any,
    ) -> EngineProcess:
        """An ``EngineProcess`` for this cluster (stopped by ``stop()`` at the latest). Its
        log goes to ``workdir/<name>.log`` unless ``log_file`` says otherwise; other
        keywords go to ``EngineProcess``."""
        kw.setdefault("log_file", self.workdir / f"{name}.log")
        child_env = {**self.engine_env(name), **(env or {})}
        with _environ(self.env):  # LD_LIBRARY_PATH must be there when the child starts
            engine = EngineProcess(model_dir, kv_transfer_config, name=name, env=child_env, **kw)
        self._engines.append(engine)
        return engine


# ----------------------------------------------------------------------------- engine side
# Functions for ``EngineProcess.call`` (they run in the engine's process, on its ``LLM``).


def store_operations(llm: Any) -> dict[str, dict[str, float]]:
    """The engine's Mooncake operations so far: ``{"<operation>/<status>": {"calls": n,
    "keys": k, "bytes": b, "failed_keys": f, "seconds": s}}`` from vLLM's
    ``vllm:mooncake_store_operation*`` counters and the sum of its operation-time histogram
    (operations such as ``load_get``, ``save_put``, ``lookup``)."""
    from prometheus_client import REGISTRY

    llm.llm_engine.do_log_stats()  # flush the step's stats into the Prometheus counters
    kinds = {
        "vllm:mooncake_store_operation_total": "calls",
        "vllm:mooncake_store_operation_keys_total": "keys",
        "vllm:mooncake_store_operation_bytes_total": "bytes",
        "vllm:mooncake_store_operation_failed_keys_total": "failed_keys",
        "vllm:mooncake_store_operation_time_seconds_sum": "seconds",
    }
    out: dict[str, dict[str, float]] = {}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            kind = kinds.get(s.name)
            if kind is None:
                continue
            key = f"{s.labels.get('operation')}/{s.labels.get('status')}"
            entry = out.setdefault(key, dict.fromkeys(kinds.values(), 0.0))
            entry[kind] += s.value
    return out


def node_counters(llm: Any) -> dict[str, Any]:
    """The root kvcompose node's counters since start (``hit_tokens.<child>``, ...)."""
    from kvcompose.introspect import node_stats

    return dict(node_stats(llm)["counters"])


def listed_keys(keys_url: str) -> list[str]:
    """The keys a master's listing (``MooncakeCluster.keys_url``) names, one a line; usable
    where no ``MooncakeCluster`` is (an engine process)."""
    with urllib.request.urlopen(keys_url, timeout=ADMIN_TIMEOUT_S) as listing:
        return [k for k in listing.read().decode().splitlines() if k.strip()]


#: What ``remove_all_after_next_hit`` did (engine process only).
FAULTS: dict[str, Any] = {}


def remove_all_after_next_hit(
    llm: Any, leaf: str, metadata_url: str, master_address: str, keys_url: str
) -> None:
    """Fault injection: the next time the leaf named ``leaf`` (a ``MooncakeStoreConnector``)
    answers a lookup with a hit, every object in the store is removed right then, from a
    client of this process's own, before the worker loads the blocks (the scheduler waits
    inside the lookup until the objects' leases allow it, at most 10 s: until the master's
    key listing, ``keys_url``, is empty). It fires once; ``fault_report`` tells how many
    objects went and how many keys were left."""
    from mooncake.store import MooncakeDistributedStore

    from kvcompose.engine.probe import scheduler_connector, walk_connectors

    nodes = list(walk_connectors(scheduler_connector(llm)))
    conn = next(n.connector for n in nodes if n.name == leaf)
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata_url, 0, 1 << 20, "tcp", "", master_address)
    if rc != 0:
        raise MooncakeError(f"the fault's store client did not start: {rc}")
    lookup = conn.get_num_new_matched_tokens
    FAULTS.clear()

    def lookup_then_remove(request: Any, num_computed_tokens: int) -> Any:
        hit = lookup(request, num_computed_tokens)
        if hit[0] and not FAULTS:  # once
            FAULTS["hit"] = hit[0]
            # an object within its lease (just written or read) is kept, and a pass that
            # removes nothing does not mean none is left: repeat until the master lists no
            # key (as ``MooncakeCluster.clear``)
            removed, t0 = 0, time.monotonic()
            while True:
                removed += max(store.remove_all(), 0)
                left = len(listed_keys(keys_url))
                if not left or time.monotonic() - t0 > 10:
                    break
                time.sleep(0.05)
            FAULTS["removed"] = removed
            FAULTS["left"] = left
            FAULTS["wait_s"] = round(time.monotonic() - t0, 2)
            store.close()
        return hit

    conn.get_num_new_matched_tokens = lookup_then_remove
    for node in nodes:  # kvcompose nodes cache their children's bound methods
        side = getattr(node.connector, "scheduler_side", None)
        if side is not None:
            side.refresh_child_methods()


def fault_report(llm: Any) -> dict[str, Any]:
    """What ``remove_all_after_next_hit`` did: the hit it answered, the objects removed."""
    return dict(FAULTS)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcompose.testing.mooncake")
    ap.add_argument("--shim", action="store_true", help="make the libibverbs symlink folder")
    ap.add_argument("--check", action="store_true", help="start a master and a pool, stop them")
    args = ap.parse_args(argv)
    if args.shim:
        print(make_ibverbs_shim())
    if args.check:
        t0 = time.perf_counter()
        with MooncakeCluster() as cluster:
            print(f"master and pool up in {time.perf_counter() - t0:.1f} s; keys {cluster.keys()}")
    if not (args.shim or args.check):
        ap.print_help()
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
