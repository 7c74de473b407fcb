"""The proxy in front of four real vLLM servers on CPU: two P and two D, NIXL over UCX
between host-memory KV buffers, each with the kvcompose tree of examples/pd (P:
first[nixl, disk]; D: first[disk, nixl], the two D sharing one disk directory).

Faults are real: D's disk tier fails a load (the fault-injecting store double, under vLLM's
default ``kv_load_failure_policy: fail`` the request ends in an error), a client leaves
mid-stream, a prefill server is SIGKILLed between its prefill and the decode, a decode server
is SIGKILLed mid-stream. In every case the client's token ids equal a single engine's greedy
output and afterwards no live engine holds a request or a KV block (read from the servers'
own /metrics). The core claim runs in the default suite (test_proxy_pd.py); this module
takes about 10 minutes on 2 cores (four servers; the 64 concurrent clients about 50 s of
it) and runs on request: KVCOMPOSE_PROXY_ENGINES=1.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import proxy_engine_bed as bed
import pytest
from proxy_sse import stream

from kvcompose.proxy import ProxyConfig, create_app
from kvcompose.testing.pd_servers import VLLMServer
from kvcompose.testing.scripted_vllm import ServerThread

pytestmark = [
    pytest.mark.engine,
    pytest.mark.pd,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        os.environ.get("KVCOMPOSE_PROXY_ENGINES") != "1",
        reason="real-engine proxy tests run with KVCOMPOSE_PROXY_ENGINES=1 (about 10 min)",
    ),
]

N = 24  # tokens decoded per request
LONG = 160  # tokens of the stream a killed decode server leaves unfinished
CLIENTS = 64  # concurrent clients ...
FAULT_EVERY = 4  # ... of which every fourth has its first attempt's load fail on D
#: the concurrent clients' prompts, one each (distinct from the first token on, so no D's
#: local cache can hold a faulty client's prompt before its load)
SEEDS = list(range(4, 4 + CLIENTS))
#: attempt 1 of these client ids fails its load on D (engine id cmpl-<rid>-1-d-0-<8 chars>),
#: by client index
FAULTY = {i: f"fault{i}" for i in range(0, CLIENTS, FAULT_EVERY)}


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VLLMServer]]:
    pytest.importorskip("nixl")
    tmp = tmp_path_factory.mktemp("proxy-engines")
    started = bed.start(
        tiny_model, tmp, ["p1", "p2"], ["d1", "d2"], [f"cmpl-{r}-1-d-0" for r in FAULTY.values()]
    )
    try:
        for p in ("p1", "p2"):
            for d in ("d1", "d2"):
                bed.handshake(started[p], started[d])
        bed.calm(started.values())
        yield started
    finally:
        bed.stop(started)


@pytest.fixture(scope="module")
def reference(servers: dict[str, VLLMServer]) -> dict[int, list[int]]:
    """Greedy output of one engine, no hand-off (P serving the prompt itself)."""
    return bed.greedy(servers["p1"], range(4 + CLIENTS), N)


@pytest.fixture(scope="module")
def proxy(servers: dict[str, VLLMServer]) -> Iterator[tuple[str, Any]]:
    thread, app = bed.proxy(servers, ["p1", "p2"], ["d1", "d2"])
    yield thread.url, app
    thread.stop()


def _alive(servers: dict[str, VLLMServer]) -> list[str]:
    return [n for n, s in servers.items() if s.proc.poll() is None]


def test_handoff_through_the_proxy_is_exact(servers, reference, proxy):
    url, _ = proxy
    with httpx.Client(base_url=url, timeout=300) as c:
        out = stream(c, "/v1/completions", bed.body(0, N))
        whole = c.post("/v1/completions", json={**bed.body(1, N), "stream_options": None}).json()
        chat = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "w5 w6 w7 w8"}],
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
        ).json()
    assert out.done and not out.errors and out.token_ids == reference[0]
    assert out.usage["completion_tokens"] == N
    assert "choices" in whole, whole
    assert "choices" in chat, chat
    assert whole["choices"][0]["token_ids"] == reference[1]
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert len(chat["choices"][0]["token_ids"]) == 8 and chat["choices"][0]["message"]["content"]
    d = {n: servers[n].metrics() for n in ("d1", "d2")}
    assert (
        sum(
            m.get("vllm:nixl_num_successful_transfers_total", 0)
            + m.get("vllm:external_prefix_cache_hits_total", 0)
            for m in d.values()
        )
        > 0
    )
    bed.idle(servers)


def test_client_disconnect_leaves_nothing_held(servers, proxy):
    url, _ = proxy
    with (
        httpx.Client(base_url=url, timeout=300) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={**bed.body(3, 400), "stream": True, "ignore_eos": True},
        ) as resp,
    ):
        for line in resp.iter_lines():
            if '"token_ids":[' in line and '"token_ids":[]' not in line:
                break  # the first token: leave
    snap = bed.idle(servers)
    assert snap["p1"].get("vllm:kv_cache_usage_perc", 0) == 0


def test_concurrent_clients_with_load_failures(servers, reference, proxy):
    """64 clients at once, every fourth one's first attempt failing its load on D: 0 lost,
    0 duplicated tokens, every client's ids equal to one engine's greedy output."""
    url, app = proxy
    with httpx.Client(base_url=url, timeout=300) as c:  # warm D's disk for the faulty ones
        for i in FAULTY:
            warm = c.post("/v1/completions", json={**bed.body(SEEDS[i], 1), "stream_options": None})
            assert warm.status_code == 200, warm.text
    bed.idle(servers)
    # D's disk tier now holds those prompts; with the local prefix caches empty it owns the
    # next load of each, so attempt 1 of every faulty client fails on whichever D serves it
    bed.reset_prefix_cache([servers["d1"], servers["d2"]])

    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        seed = SEEDS[i]
        headers = {"X-Request-Id": FAULTY[i]} if i in FAULTY else {}
        got: list[int] = []
        async with client.stream(
            "POST", "/v1/completions", json={**bed.body(seed, N), "stream": True}, headers=headers
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", ()):
                        got.extend(ch.get("token_ids") or ())
        return got

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(len(SEEDS))))

    injected_before = bed.injected(servers, ["d1", "d2"], "cmpl-fault")
    before = bed.retries(app, "decode_error")
    results = asyncio.run(main())
    assert results == [reference[s] for s in SEEDS]
    # every injected failure fired, was retried, and reached no client
    assert bed.injected(servers, ["d1", "d2"], "cmpl-fault") - injected_before == len(FAULTY)
    assert bed.retries(app, "decode_error") - before == len(FAULTY)
    bed.idle(servers)


def test_prefill_killed_before_the_decode_is_retried_on_the_other(servers, reference):
    """P1 answers the prefill and is SIGKILLed before the proxy hands its blocks to D: D's
    NIXL read from a dead engine fails, and the next attempt runs on P2."""
    killed: list[str] = []

    async def kill_p1(response: httpx.Response) -> None:
        req = response.request
        is_p1 = req.url.port == servers["p1"].port
        if is_p1 and not killed and b'"do_remote_decode"' in req.content:
            await response.aread()  # P's answer arrived whole; then P dies
            servers["p1"].kill()
            killed.append(str(req.url))

    client = httpx.AsyncClient(event_hooks={"response": [kill_p1]})
    app = create_app(
        ProxyConfig(
            prefill=[servers["p1"].url, servers["p2"].url],
            decode=[servers["d1"].url, servers["d2"].url],
            backoff_s=0.05,
            health_interval_s=0.5,
            timeouts={**bed.TIMEOUTS, "read": 120},
        ),
        http_client=client,
    )
    thread = ServerThread(app).start()  # fresh: its first prefill goes to p1
    try:
        with httpx.Client(base_url=thread.url, timeout=300) as c:
            # a prompt no disk tier holds: D's NIXL owns the load from P1
            out = stream(c, "/v1/completions", bed.body(2, N))
    finally:
        thread.stop()
        asyncio.run(client.aclose())
    assert killed and servers["p1"].proc.poll() is not None
    assert out.done and not out.errors, out.events[-3:]
    assert out.token_ids == reference[2]
    causes = {c: bed.retries(app, c) for c in ("decode_error", "decode_failed", "stream_dropped")}
    assert sum(causes.values()) == 1, causes  # one failed attempt, then P2
    assert app.state.pool.prefill[1].served >= 1
    bed.idle(servers)


def test_decode_killed_mid_stream_continues_on_the_other(servers):
    want = bed.greedy(servers["p2"], [0], LONG, ignore_eos=True)[0]
    thread, app = bed.proxy(servers, _alive_prefill(servers), ["d1", "d2"])  # fresh: d1 first
    got: list[int] = []
    at = LONG
    try:
        with (
            httpx.Client(base_url=thread.url, timeout=300) as c,
            c.stream(
                "POST",
                "/v1/completions",
                json={**bed.body(0, LONG), "stream": True, "ignore_eos": True},
            ) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:]).get("choices", ()):
                        got.extend(ch.get("token_ids") or ())
                    if len(got) >= 3 and servers["d1"].proc.poll() is None:
                        servers["d1"].kill()
                        at = len(got)
    finally:
        thread.stop()
    assert servers["d1"].proc.poll() is not None
    assert at < LONG  # d1 was killed with the stream unfinished
    assert got == want
    assert bed.retries(app, "stream_dropped") == 1
    bed.idle(servers)


def _alive_prefill(servers: dict[str, VLLMServer]) -> list[str]:
    return [n for n in _alive(servers) if n.startswith("p")]
