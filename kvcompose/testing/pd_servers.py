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

from kvcompose.engine import nixl_poll
from kvcompose.testing.ports import free_port

#: Engine settings for the tiny model on a few CPU cores.
SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # The engine core (a process of its own: ``AsyncLLM`` always starts one) runs the model
    # in itself with vLLM's uniproc executor, as vLLM does on one GPU. With "1" the CPU
    # platform (``CpuPlatform.check_and_update_config``) forces the multiproc executor, a
    # third process per server that spawns and imports vLLM again (~12 s of a core).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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
            **nixl_poll.environment(),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.nixl_port),
            **(env or {}),
        }
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout: float = 400.0) -> None:
        """Wait until the server answers ``/health``. A server whose listener could not bind
        (vLLM's ``_nixl_handshake_listener`` dies in its thread, and the server then never
        reports healthy) fails at once rather than after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n"
                                   f"{self.log_tail()}")  # fmt: skip
            if "Address already in use" in self.log_tail(lines=400):
                raise RuntimeError(f"{self.name} could not bind a port:\n{self.log_tail()}")
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
