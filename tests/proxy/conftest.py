"""Scripted vLLM servers (two prefill, two decode) and a proxy in front of them, all on
127.0.0.1 in threads of this process (kvcompose.testing.scripted_vllm)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvcompose.proxy import ProxyConfig, create_app
from kvcompose.testing.scripted_vllm import Fabric, ScriptedVLLM, ServerThread

#: the scripted servers' context: a chat without max_tokens runs to it in about a second
MAX_MODEL_LEN = 512


@dataclass
class Bed:
    fabric: Fabric
    prefill: list[ScriptedVLLM]
    decode: list[ScriptedVLLM]
    urls: dict[str, str]
    proxy_url: str = ""
    app: Any = None

    def all(self) -> list[ScriptedVLLM]:
        return [*self.prefill, *self.decode]

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.proxy_url, **{"timeout": 30, **kw})

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(name, labels or None)
        return value or 0.0


@pytest.fixture(scope="module")
def backends() -> Iterator[tuple[Fabric, list[ScriptedVLLM], list[ServerThread]]]:
    fabric = Fabric()
    servers = [
        ScriptedVLLM(n, fabric, token_delay=0.002, max_model_len=MAX_MODEL_LEN)
        for n in ("p1", "p2", "d1", "d2")
    ]
    threads = [ServerThread(s.app).start() for s in servers]
    yield fabric, servers, threads
    for t in threads:
        t.stop()


def start_proxy(bed: Bed, **overrides: Any) -> ServerThread:
    config = ProxyConfig(
        prefill=[bed.urls["p1"], bed.urls["p2"]],
        decode=[bed.urls["d1"], bed.urls["d2"]],
        backoff_s=0.01,
        backoff_max_s=0.05,
        health_interval_s=0.2,
        **overrides,
    )
    bed.app = create_app(config)
    thread = ServerThread(bed.app).start()
    bed.proxy_url = thread.url
    return thread


@pytest.fixture
def bed(backends) -> Iterator[Bed]:
    fabric, servers, threads = backends
    for s in servers:
        s.faults.clear()
        s.requests.clear()
        s.aborted.clear()
        s.healthy = True
        s.steps_per_chunk = 1
    fabric.held.clear()
    fabric.released.clear()
    b = Bed(
        fabric,
        servers[:2],
        servers[2:],
        {s.name: t.url for s, t in zip(servers, threads, strict=True)},
    )
    proxy = start_proxy(b)
    yield b
    proxy.stop()
