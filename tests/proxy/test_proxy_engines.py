"""The proxy in front of four real vLLM servers on CPU, in the default suite: two P and two
D, NIXL over UCX between host-memory KV buffers, each with the kvcompose tree of
examples/pd (P: first[nixl, disk]; D: first[disk, nixl], the two D sharing one disk
directory), started once for the module.

Faults are real: D's disk tier fails a load (the fault-injecting store double, under vLLM's
default ``kv_load_failure_policy: fail`` the request ends in an error), a client leaves
mid-stream, a prefill server is SIGKILLed between its prefill and the decode, a decode server
is SIGKILLed mid-stream (these two last: they kill servers). In every case the client's
token ids equal a single engine's greedy output and afterwards no live engine holds a
request or a KV block (read from the servers' own /metrics). Where the proxy rewrites a
request (chat to token ids, budgets, stop strings), its answer equals P's own answer to the
same request. With KVCOMPOSE_PROXY_ENGINES=1 also: the whole (not streamed) answers, and
64 concurrent clients with every fourth one's first load failing (docs/proxy.md, Tests).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import proxy_engine_bed as bed
import pytest
from proxy_sse import stream

from kvcompose.engine.model import word
from kvcompose.proxy import ProxyConfig, create_app
from kvcompose.testing.pd_servers import VLLMServer
from kvcompose.testing.scripted_vllm import ServerThread

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(900)]

#: the longer cases: every hand-off costs seconds on a loaded 2-core machine
ON_REQUEST = pytest.mark.skipif(
    os.environ.get("KVCOMPOSE_PROXY_ENGINES") != "1",
    reason="runs with KVCOMPOSE_PROXY_ENGINES=1 (docs/proxy.md, Tests)",
)

N = 16  # tokens decoded per request
FAULT = "pdfault"  # attempt 1 of this client id fails its load on D
#: tokens of the stream a killed decode server leaves unfinished (D runs on after the proxy
#: reads its first chunk; what D sent before it died is still read, so D must not be done)
LONG = 400
CLIENTS = 64  # concurrent clients (on request) ...
FAULT_EVERY = 4  # ... of which every fourth has its first attempt's load fail on D
#: the concurrent clients' prompts, one each (distinct from the first token on, so no D's
#: local cache can hold a faulty client's prompt before its load); the other tests' seeds
#: are below 20
SEEDS = list(range(20, 20 + CLIENTS))
#: attempt 1 of these client ids fails its load on D (engine id cmpl-<rid>-1-d-0-<8 chars>)
FAULTY = {i: f"fault{i}" for i in range(0, CLIENTS, FAULT_EVERY)}
FAIL_IDS = [f"cmpl-{FAULT}-1-d-0", *(f"cmpl-{r}-1-d-0" for r in FAULTY.values())]


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VLLMServer]]:
    pytest.importorskip("nixl")
    tmp = tmp_path_factory.mktemp("proxy-engines")
    started = bed.start(tiny_model, tmp, ["p1", "p2"], ["d1", "d2"], FAIL_IDS)
    try:
        # NIXL's first handshake of each pair, out of the tests' counts and timeouts
        bed.handshake_all(started, ["p1", "p2"], ["d1", "d2"])
        yield started
    finally:
        bed.stop(started)


@pytest.fixture(scope="module")
def proxy(servers: dict[str, VLLMServer]) -> Iterator[tuple[str, Any]]:
    thread, app = bed.proxy(servers, ["p1", "p2"], ["d1", "d2"])
    yield thread.url, app
    thread.stop()


def _decoders(servers: dict[str, VLLMServer]) -> list[VLLMServer]:
    return [servers["d1"], servers["d2"]]


def _external_hits(servers: dict[str, VLLMServer]) -> float:
    return sum(
        d.metrics().get("vllm:external_prefix_cache_hits_total", 0) for d in _decoders(servers)
    )


def test_decode_load_failure_is_continued_token_exact(servers, proxy):
    url, app = proxy
    want = bed.greedy(servers["p1"], [0], N)[0]
    with httpx.Client(base_url=url, timeout=600) as c:
        # a first hand-off warms the D's shared disk tier with the prompt ...
        warm = c.post("/v1/completions", json={**bed.body(0, 1), "stream_options": None})
        assert warm.status_code == 200, warm.text
        bed.reset_prefix_cache(_decoders(servers))  # ... which then owns a D's next load
        before = bed.retries(app, "decode_error")
        out = stream(c, "/v1/completions", bed.body(0, N), headers={"X-Request-Id": FAULT})
    assert out.done and not out.errors, out.events[-3:]
    assert out.token_ids == want
    assert out.usage["completion_tokens"] == N
    assert len({e["id"] for e in out.events}) == 1
    assert bed.injected(servers, ["d1", "d2"], f"cmpl-{FAULT}") == 1
    assert bed.retries(app, "decode_error") - before == 1
    snap = bed.idle(servers)
    assert snap["p1"].get("vllm:kv_cache_usage_perc", 0) == 0


#: a chat prompt of three full blocks (the tiny tokenizer: one token per word)
CHAT = [{"role": "user", "content": " ".join(f"w{i}" for i in range(5, 105))}]


@pytest.mark.parametrize(
    ("path", "streamed", "seed"),
    [
        pytest.param("/v1/completions", True, 5, id="completions-stream"),
        pytest.param("/v1/chat/completions", True, 7, id="chat-stream"),
        pytest.param("/v1/completions", False, 6, id="completions-whole", marks=ON_REQUEST),
        pytest.param("/v1/chat/completions", False, 8, id="chat-whole", marks=ON_REQUEST),
    ],
)
def test_handoff_equals_one_engines_answer(servers, proxy, path, streamed, seed):
    url, _ = proxy
    if path == "/v1/chat/completions":  # a prompt of its own per test (no prefix shared)
        body = {"messages": [{"role": "user", "content": f"w{500 + seed}"}, *CHAT]}
    else:
        body = {"prompt": bed.prompt(seed)}
    body = {**body, "max_tokens": N, "ignore_eos": True}
    want = bed.read_answer([bed.direct(servers["p1"], path, body)])
    hits = _external_hits(servers)
    asked = {**body, "temperature": 0, "return_token_ids": True}
    with httpx.Client(base_url=url, timeout=600) as c:
        if streamed:
            out = stream(c, path, {**asked, "stream_options": {"include_usage": True}})
            assert out.status == 200 and out.done and not out.errors, out.body or out.events[-3:]
            events, usage = out.events, out.usage
            if path == "/v1/chat/completions":  # one role chunk, the first
                roles = [e for e in out.chunks if e["choices"][0]["delta"].get("role")]
                assert len(roles) == 1 and out.chunks[0] is roles[0]
        else:
            resp = c.post(path, json=asked)
            assert resp.status_code == 200, resp.text
            events, usage = [resp.json()], resp.json()["usage"]
    got = bed.read_answer(events)
    assert got == want  # text, token ids, prompt ids (chat: the template applied once)
    assert len(got[1]) == N and got[0]
    assert usage == {"prompt_tokens": len(want[2]), "completion_tokens": N,
                     "total_tokens": len(want[2]) + N}  # fmt: skip
    assert len({e["id"] for e in events}) == 1
    # a D loaded the prompt's blocks from P (NIXL), it did not compute them
    assert _external_hits(servers) > hits
    snap = bed.idle(servers)
    assert snap["p1"].get("vllm:kv_cache_usage_perc", 0) == 0


# ------------------------------------------------------------------ vLLM's semantics
# Where the proxy rewrites a request (chat to token ids, stop strings, budgets), its answer
# equals the one P's engine gives to the same request sent to it directly.

#: a chat prompt that leaves about 40 tokens of the 1024-token context
LONG_CHAT = [{"role": "user", "content": " ".join(f"w{i % 1000}" for i in range(980))}]
USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")


def test_chat_without_max_tokens_equals_vllm_chat(servers, proxy):
    """vLLM's chat without ``max_tokens``/``max_completion_tokens`` generates until EOS or
    ``max_model_len`` (``get_max_tokens``), not completions' 16."""
    url, _ = proxy
    body = {"messages": LONG_CHAT}
    want = bed.direct(servers["p1"], "/v1/chat/completions", body)
    with httpx.Client(base_url=url, timeout=600) as c:
        out = stream(c, "/v1/chat/completions",
                     {**body, "temperature": 0, "return_token_ids": True,
                      "stream_options": {"include_usage": True}})  # fmt: skip
    assert out.status == 200 and out.done and not out.errors, out.body or out.events[-3:]
    assert bed.read_answer(out.events) == bed.read_answer([want])
    assert {k: out.usage[k] for k in USAGE} == {k: want["usage"][k] for k in USAGE}
    assert want["usage"]["completion_tokens"] > 16
    assert out.finish["finish_reason"] == want["choices"][0]["finish_reason"]


@pytest.mark.parametrize("case", ["min_tokens", "tie"])
def test_min_tokens_and_stop_strings_equal_vllm(servers, proxy, case):
    """``BaseIncrementalDetokenizer.update`` (no stop string before ``min_tokens`` tokens)
    and ``check_stop_strings`` (the match ending first wins, ties by the list's order):
    the proxy's text, ids, finish and stop reasons equal P's own answer."""
    url, _ = proxy
    base = {"prompt": bed.prompt(9), "max_tokens": 16, "ignore_eos": True}
    ids = bed.direct(servers["p1"], "/v1/completions", base)["choices"][0]["token_ids"]
    words = [word(t) for t in ids]
    extra = {
        # token 3 completes the first stop string; with min_tokens 4 it does not count
        "min_tokens": {"stop": [words[2], words[7]], "min_tokens": 4},
        # both end with token 6: vLLM takes the first in the list, not the earlier start
        "tie": {"stop": [words[5], f"{words[4]} {words[5]}"]},
    }[case]
    want = bed.direct(servers["p1"], "/v1/completions", {**base, **extra})
    with httpx.Client(base_url=url, timeout=600) as c:
        resp = c.post("/v1/completions", json={**base, **extra, "temperature": 0,
                                               "return_token_ids": True})  # fmt: skip
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert bed.read_answer([got]) == bed.read_answer([want])
    for key in ("finish_reason", "stop_reason"):
        assert got["choices"][0][key] == want["choices"][0][key], key
    assert want["choices"][0]["finish_reason"] == "stop", want
    bed.idle(servers)


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/completions", {"max_tokens": 0}),
        ("/v1/chat/completions", {"max_completion_tokens": 0}),
        ("/v1/completions", {"max_tokens": 2000}),
        ("/v1/chat/completions", {"max_completion_tokens": 2000}),
        ("/v1/completions", {"max_tokens": 4, "temperature": "hot"}),
    ],
    ids=[
        "max_tokens-0",
        "chat-max_completion_tokens-0",
        "max_tokens-over-context",
        "chat-max_completion_tokens-over-context",
        "temperature-hot",
    ],
)
def test_refusals_equal_vllms(servers, proxy, path, extra):
    """``max_tokens: 0`` (``SamplingParams._verify_args``) and a limit above the context
    (``TokenizeParams.__post_init__``) are the proxy's own 400s, a bad
    sampling field the proxy does not read is P's: either way the client gets vLLM's
    answer to the same request, and no hand-off is prepared."""
    url, _ = proxy
    body = {"prompt": bed.prompt(10)} if path == "/v1/completions" else {"messages": CHAT}
    body = {**body, **extra}
    direct = httpx.post(f"{servers['p1'].url}{path}", json=body, timeout=60)
    got = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert direct.status_code == 400, direct.text
    assert (got.status_code, got.json()) == (400, direct.json())
    bed.idle(servers)


# ------------------------------------------------------------------ clients and load


def test_client_disconnect_leaves_nothing_held(servers, proxy):
    url, _ = proxy
    with (
        httpx.Client(base_url=url, timeout=300) as c,
        c.stream(
            "POST",
            "/v1/completions",
            json={**bed.body(13, 400), "stream": True, "ignore_eos": True},
        ) as resp,
    ):
        for line in resp.iter_lines():
            if '"token_ids":[' in line and '"token_ids":[]' not in line:
                break  # the first token: leave
    snap = bed.idle(servers)
    assert snap["p1"].get("vllm:kv_cache_usage_perc", 0) == 0
    assert snap["p2"].get("vllm:kv_cache_usage_perc", 0) == 0


@ON_REQUEST
def test_concurrent_clients_with_load_failures(servers, proxy):
    """64 clients at once, every fourth one's first attempt failing its load on D: 0 lost,
    0 duplicated tokens, every client's ids equal to one engine's greedy output."""
    url, app = proxy
    reference = bed.greedy(servers["p1"], SEEDS, N)
    with httpx.Client(base_url=url, timeout=300) as c:  # warm D's disk for the faulty ones
        for i in FAULTY:
            warm = c.post("/v1/completions", json={**bed.body(SEEDS[i], 1), "stream_options": None})
            assert warm.status_code == 200, warm.text
    bed.idle(servers)
    # D's disk tier now holds those prompts; with the local prefix caches empty it owns the
    # next load of each, so attempt 1 of every faulty client fails on whichever D serves it
    bed.reset_prefix_cache(_decoders(servers))

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


# ------------------------------------------------------------------ killed servers (last)


def test_prefill_killed_before_the_decode_is_retried_on_the_other(servers):
    """P1 answers the prefill and is SIGKILLed before the proxy hands its blocks to D: D's
    NIXL read from a dead engine fails, and the next attempt runs on P2."""
    want = bed.greedy(servers["p2"], [12], N)[12]
    transport = _Kill(servers["p1"], when=_prefill, at="end")
    client = httpx.AsyncClient(transport=transport)
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
    thread = ServerThread(app).start(timeout=bed.START_S)  # fresh: its first prefill goes to p1
    try:
        with httpx.Client(base_url=thread.url, timeout=300) as c:
            # a prompt no disk tier holds: D's NIXL owns the load from P1
            out = stream(c, "/v1/completions", bed.body(12, N))
    finally:
        thread.stop()
        asyncio.run(client.aclose())
    assert transport.killed and servers["p1"].proc.poll() is not None
    assert out.done and not out.errors, out.events[-3:]
    assert out.token_ids == want
    causes = {c: bed.retries(app, c) for c in ("decode_error", "decode_failed", "stream_dropped")}
    assert sum(causes.values()) == 1, causes  # one failed attempt, then P2
    assert app.state.pool.prefill[1].served >= 1
    bed.idle(servers)


class _Chunks(httpx.AsyncByteStream):
    """A response body that calls ``at_end`` once its last chunk was handed on."""

    def __init__(self, inner: Any, at_end: Callable[[], None]) -> None:
        self.inner, self.at_end = inner, at_end

    async def __aiter__(self) -> Any:
        async for chunk in self.inner:
            yield chunk
        self.at_end()

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BreaksAfterFirstToken(httpx.AsyncByteStream):
    """A streamed body handed on up to the end of its first event with token ids; then
    ``kill`` runs and the body breaks off there, as httpx reports a server that died
    mid-body. What the server had written past that event is dropped with it: killed
    only once the proxy had read that event, D had in a loaded CI run (2026-12-03) already
    written its whole stream into the socket, so the proxy read it all and nothing was
    retried."""

    def __init__(self, inner: Any, kill: Callable[[], None]) -> None:
        self.inner, self.kill = inner, kill

    async def __aiter__(self) -> Any:
        held = b""
        async for chunk in self.inner:
            held += chunk
            token = held.find(b"token_ids")
            end = held.find(b"\n\n", token) if token >= 0 else -1
            if end < 0:
                continue  # that event is not whole yet
            yield held[: end + 2]
            self.kill()
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body (killed)"
            )
        if held:
            yield held

    async def aclose(self) -> None:
        await self.inner.aclose()


def _prefill(request: httpx.Request) -> bool:
    return b'"do_remote_decode"' in request.content


def _completion(request: httpx.Request) -> bool:
    return request.url.path.endswith("/completions")


class _Kill(httpx.AsyncBaseTransport):
    """The proxy's transport, which SIGKILLs ``server`` while the proxy reads the first of
    that server's responses ``when`` selects: ``at="first_token"`` right after the first
    event with token ids, the body breaking off there (D dies mid-stream, whatever the
    test's client has read by then: killed from the client instead, D once sent all it had
    to the proxy before the client saw its first token, so no retry was needed),
    ``at="end"`` once the proxy has read it whole (P dies between its answer and the
    hand-off to D)."""

    def __init__(
        self, server: VLLMServer, *, when: Callable[[httpx.Request], bool], at: str
    ) -> None:
        assert at in ("first_token", "end")
        self.server, self.when, self.at = server, when, at
        self.inner = httpx.AsyncHTTPTransport()
        self.killed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.killed or request.url.port != self.server.port or not self.when(request):
            return response
        stream = (
            _BreaksAfterFirstToken(response.stream, self._kill)
            if self.at == "first_token"
            else _Chunks(response.stream, self._kill)
        )
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
        )

    def _kill(self) -> None:
        if not self.killed:
            self.killed = True
            self.server.kill()

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_decode_killed_mid_stream_continues_on_the_other(servers):
    want = bed.greedy(servers["p2"], [11], LONG, ignore_eos=True)[11]
    alive_prefill = [p for p in ("p1", "p2") if servers[p].proc.poll() is None]
    transport = _Kill(servers["d1"], when=_completion, at="first_token")
    client = httpx.AsyncClient(transport=transport)
    app = create_app(
        ProxyConfig(
            prefill=[servers[p].url for p in alive_prefill],
            decode=[servers["d1"].url, servers["d2"].url],
            backoff_s=0.05,
            health_interval_s=0.5,
            timeouts=bed.TIMEOUTS,
        ),
        http_client=client,
    )
    thread = ServerThread(app).start(timeout=bed.START_S)  # fresh: d1 first
    try:
        with httpx.Client(base_url=thread.url, timeout=300) as c:
            out = stream(c, "/v1/completions", {**bed.body(11, LONG), "ignore_eos": True})
    finally:
        thread.stop()
        asyncio.run(client.aclose())
    assert transport.killed and servers["d1"].proc.poll() is not None
    assert out.done and not out.errors, out.events[-3:]
    assert out.token_ids == want
    assert bed.retries(app, "stream_dropped") == 1
    bed.idle(servers)
