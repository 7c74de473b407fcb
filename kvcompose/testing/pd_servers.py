"""Real vLLM OpenAI servers for prefill/decode tests (``vllm.entrypoints.openai.api_server``).

Each :class:`VLLMServer` is a server process (and its engine-core process) in a process group
of its own, so a test can kill it outright as a crash would. Everything listens on 127.0.0.1;
each server gets its own NIXL side-channel port. Configs are the dict form of
``KVTransferConfig`` (what ``kvcompose vllm-args --json`` prints).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvcompose.testing.ports import free_port

#: Engine settings for the tiny model on a few CPU cores.
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}


def rendered_config(yaml_path: str | Path) -> dict[str, Any]:
    """What ``kvcompose vllm-args --json FILE`` prints: the ``--kv-transfer-config`` of a
    kvcompose file. Rendered in this process without the checks that import vLLM (the
    server runs them when it loads the connector): the CLI in a subprocess spent 10-30 s
    of a loaded 2-core machine importing vLLM, once per config, before any server started."""
    from kvcompose.config import load_config
    from kvcompose.config.render import vllm_args

    return vllm_args(load_config(str(yaml_path), check_vllm=False))


class VLLMServer:
    def __init__(self, name: str, model: str | Path, kv_transfer_config: dict[str, Any] | None,
                 log_dir: Path, *, max_model_len: int = 1024, block_size: int = 32,
                 extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.port = free_port()
        self.nixl_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--block-size",
            str(block_size),
            "--seed",
            "0",
            *extra_args,
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        full_env = {
            **os.environ,
            **SERVER_ENV,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            **(env or {}),
        }
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout: float = 400.0, *, calm_nixl: bool = False) -> None:
        """Wait until the server answers ``/health``. A server whose listener could not bind
        (vLLM's ``_nixl_handshake_listener`` dies in its thread, and the server then never
        reports healthy) fails at once rather than after ``timeout``. With ``calm_nixl``,
        NIXL's progress thread is calmed (:meth:`calm_busy_threads`) as soon as NIXL's agent
        exists: it spins from then on, and servers starting side by side spent the rest of
        their start beside one spinning thread each (measured: the agents of four servers
        on two cores came up 20-30 s before the servers were ready)."""
        deadline = time.monotonic() + timeout
        calmed = not calm_nixl
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")  # fmt: skip
            log = self.log_tail(lines=400)
            if "Address already in use" in log:
                raise RuntimeError(f"{self.name} could not bind a port:\n{self.log_tail()}")
            if not calmed and "Initialized NIXL agent" in log:
                # the busiest thread only: NIXL's agent has one progress thread, and other
                # threads busy during the start (UCX's, vLLM's) must keep their priority
                calmed = bool(self.calm_busy_threads(seconds=1.0, most=1))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples (``vllm:*``), summed over labels, by sample name."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def thread_ticks(self) -> dict[int, int]:
        """CPU time (clock ticks) used so far by every thread of the server's processes."""
        out: dict[int, int] = {}
        for task in _session_tasks(self.proc.pid):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                out[int(task.name)] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    def calm_busy_threads(
        self, seconds: float = 2.0, share: float = 0.25, most: int | None = None
    ) -> list[int]:
        """Move the threads that keep a core busy while the server is idle to SCHED_IDLE.

        NIXL's agent runs a UCX progress thread with no delay between polls (``nixl``'s
        ``_api.py`` sets ``pthrDelay = 0``; vLLM's ``nixl/base_worker.py`` does not expose
        it), which keeps ~70 % of a core busy per idle engine on this CPU-only machine
        (measured: ``nixlUcxSharedThread::run`` -> ``ucp_worker_arm`` in a loop). Three
        engines on two cores then starve the engines' own compute, the proxy and the
        clients (health checks and reads time out). Under SCHED_IDLE the thread still
        polls whenever a core has nothing else to run, so transfers keep working. Call
        while the server is idle, or with ``most`` (the busiest ``most`` threads only);
        returns the thread ids moved."""
        before = self.thread_ticks()
        time.sleep(seconds)
        after = self.thread_ticks()
        hz = os.sysconf("SC_CLK_TCK")
        busy = [t for t, n in after.items() if (n - before.get(t, n)) / hz > share * seconds]
        busy = [t for t in busy if _policy(t) != os.SCHED_IDLE]  # not those moved already
        # never a process's main thread: the worker's computes, and it busy-polls its
        # message queue for a second after each step (vLLM's shm_broadcast SpinCondition)
        mains = {int(task.parent.parent.name) for task in _session_tasks(self.proc.pid)}
        busy = [t for t in busy if t not in mains]
        busy = sorted(busy, key=lambda t: before.get(t, 0) - after[t])[:most]
        for tid in busy:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return busy

    def kill(self) -> None:
        """SIGKILL the server and its engine core: what a crashed machine looks like."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def _policy(tid: int) -> int | None:
    try:
        return os.sched_getscheduler(tid)
    except OSError:
        return None


def _session_tasks(pid: int) -> list[Path]:
    """/proc/<pid>/task/<tid> of every process in the session led by ``pid``."""
    tasks: list[Path] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.getsid(int(proc.name)) == pid:
                tasks.extend((proc / "task").iterdir())
    return tasks
