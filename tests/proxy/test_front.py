"""The proxy's HTTP surface against scripted vLLM servers: bad input, health, metrics,
client disconnects (nothing held afterwards), and many concurrent clients with faults."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from polling import eventually
from proxy_sse import stream

from kvcompose.proxy.backends import BackendPool, check_all
from kvcompose.proxy.stops import StopMatch, StopStrings
from kvcompose.testing.scripted_vllm import MODEL, Fault, detok, reference, tokenize

PROMPT = " ".join(f"w{i}" for i in range(100, 140))


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "at least one message"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": 2}, 400, "n > 1"),
        ("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 2}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "logprobs": True},
            400,
            "logprobs",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": ["w1", "w2"]}, 400, "batch"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
        ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404, "does not exist"),
        ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": -1}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "w1", "kv_transfer_params": {"do_remote_decode": True}},
            400,
            "proxy",
        ),
    ],
)
def test_bad_input_is_a_clear_error(bed, path, body, status, words):
    with bed.client() as c:
        resp = c.post(path, json=body)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert words in err["message"] and err["code"] == status
    assert not [r for s in bed.all() for r in s.requests]  # nothing reached a backend


def test_malformed_json_and_a_non_object(bed):
    with bed.client() as c:
        r1 = c.post(
            "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        r2 = c.post("/v1/completions", json=[1, 2])
    assert r1.status_code == 400 and "not valid JSON" in r1.json()["error"]["message"]
    assert r2.status_code == 400 and "JSON object" in r2.json()["error"]["message"]


def test_a_huge_or_deeply_nested_body_is_refused(bed):
    from kvcompose.proxy.app import MAX_BODY_BYTES

    huge = b'{"prompt": "' + b"w" * MAX_BODY_BYTES + b'"}'

    def chunked():  # no Content-Length: the proxy counts what it reads
        for i in range(0, len(huge), 1 << 20):
            yield huge[i : i + (1 << 20)]

    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with bed.client() as c:
        sized = c.post("/v1/completions", content=huge)
        streamed = c.post("/v1/completions", content=chunked())
        nested = c.post("/v1/completions", content=deep)
    for resp in (sized, streamed):
        assert resp.status_code == 413, resp.text[:200]
        assert "larger than 32 MiB" in resp.json()["error"]["message"]
    assert nested.status_code == 400 and "nested too deeply" in nested.json()["error"]["message"]
    assert not [r for s in bed.all() for r in s.requests]  # nothing reached a backend


def test_models_health_metrics(bed):
    with bed.client() as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert c.get("/health").status_code == 200
        c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        text = c.get("/metrics").text
    for name in (
        "kvcompose_proxy_requests_total",
        "kvcompose_proxy_attempts_per_request",
        "kvcompose_proxy_backend_seconds",
        "kvcompose_proxy_in_flight",
        "kvcompose_proxy_backend_healthy",
        "kvcompose_proxy_retries_total",
    ):
        assert name in text
    assert bed.metric("kvcompose_proxy_requests_total", endpoint="completions", outcome="ok") == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_prompt_token_ids_where_vllm_puts_them(bed, streamed):
    """On a chat response (its first chunk when streamed), on a completion's choice: vLLM's
    ``ChatCompletionResponse``/``ChatCompletionStreamResponse`` and
    ``CompletionResponseChoice``/``CompletionResponseStreamChoice``."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w1 w2 w3 w4"}]}
    cmpl = {"model": MODEL, "prompt": PROMPT}
    answers = {}
    with bed.client() as c:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", cmpl)):
            body = {**body, "max_tokens": 3, "return_token_ids": True}
            if streamed:
                out = stream(c, path, body)
                assert out.status == 200 and out.done, out.body
                answers[path] = out.events
            else:
                resp = c.post(path, json=body)
                assert resp.status_code == 200, resp.text
                answers[path] = [resp.json()]
    chat_events, cmpl_events = answers["/v1/chat/completions"], answers["/v1/completions"]
    assert chat_events[0]["prompt_token_ids"] == [1002, 1, 2, 3, 4, 1003]
    assert cmpl_events[0]["choices"][0]["prompt_token_ids"] == tokenize(PROMPT)
    assert all("prompt_token_ids" not in ch for e in chat_events for ch in e["choices"])
    assert all("prompt_token_ids" not in e for e in cmpl_events)
    # once per answer
    assert sum("prompt_token_ids" in e for e in chat_events) == 1
    assert sum("prompt_token_ids" in ch for e in cmpl_events for ch in e["choices"]) == 1


def test_health_checks_take_a_backend_out_and_put_it_back(bed):
    for d in bed.decode:
        d.healthy = False
    with bed.client() as c:
        assert eventually(lambda: c.get("/health").status_code == 503)
        down = c.get("/health").json()["down"]["decode"]
        assert sorted(down) == sorted([bed.urls["d1"], bed.urls["d2"]])
        bed.decode[1].healthy = True
        assert eventually(lambda: c.get("/health").status_code == 200)
        out = stream(c, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert out.text == detok(reference(tokenize(PROMPT), 4))
    assert bed.decode[1].requests and not bed.decode[0].requests


def test_unreachable_backends_are_a_503_naming_them(bed):
    from kvcompose.proxy import ProxyConfig, create_app
    from kvcompose.testing.scripted_vllm import ServerThread

    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    app = create_app(ProxyConfig(prefill=[dead], decode=[bed.urls["d1"]], backoff_s=0.01))
    proxy = ServerThread(app).start()
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as c:
            resp = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7]})
            health = c.get("/health")
    finally:
        proxy.stop()
    assert resp.status_code == 503
    assert dead in resp.json()["error"]["message"] and "prefill" in resp.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["down"]["prefill"] == [dead]


def test_client_disconnect_mid_stream_aborts_on_decode(bed):
    bed.decode[0].token_delay = 0.05
    try:
        with (
            bed.client() as c,
            c.stream(
                "POST",
                "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True},
            ) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break  # one token came: leave
        assert eventually(lambda: bed.decode[0].aborted), "D kept generating for a client gone"
    finally:
        bed.decode[0].token_delay = 0.002
    assert not bed.fabric.held


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_client_leaving_during_the_prefill_aborts_it(bed, streamed):
    """P is aborted (its connection closed, as vLLM's ``with_cancellation`` then aborts the
    request) and D never hears of the request; streamed or not."""
    bed.prefill[0].fail_next(Fault("delay", seconds=1.0))
    body = {"model": MODEL, "prompt": tokenize(PROMPT), "max_tokens": 5, "stream": streamed}
    with bed.client(timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    assert eventually(lambda: bed.prefill[0].aborted), "P kept prefilling for a client gone"
    time.sleep(1.0)  # P's delay is over: had it not been aborted, it would hold the blocks
    assert not bed.fabric.held
    assert not [r for s in bed.decode for r in s.requests]  # D never saw it, no release
    outcome = "disconnected"
    assert bed.metric("kvcompose_proxy_requests_total", endpoint="completions",
                      outcome=outcome) == 1  # fmt: skip


def test_client_leaving_once_p_answers_releases_the_handoff(bed):
    """Once P's answer began, its prefill is over and it holds the blocks for a D: the proxy
    reads the answer and has a D reject the hand-off (P frees the blocks), D decodes
    nothing."""
    bed.prefill[0].fail_next(Fault("slow_answer", seconds=1.0))
    body = {"model": MODEL, "prompt": tokenize(PROMPT), "max_tokens": 5, "stream": True}
    with bed.client(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=body)
    assert eventually(lambda: bed.fabric.released), "P still holds the hand-off"
    assert not bed.fabric.held and not bed.prefill[0].aborted
    decode = [r for s in bed.decode for r in s.requests]
    assert [bool(r.get("use_beam_search")) for r in decode] == [True]  # the release only


def test_concurrent_clients_with_faults_lose_and_duplicate_nothing(bed):
    prompts = [[(7 * i + j) % 997 + 3 for j in range(20 + i % 7)] for i in range(64)]
    kinds = [
        Fault("drop", after=3),
        Fault("load_fail"),
        Fault("recomputed", after=5),
        Fault("status", code=500),
        Fault("abort", after=1),
    ]
    for i in range(16):  # a fault every four requests or so
        bed.decode[i % 2].fail_next(kinds[i % len(kinds)])

    async def one(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
        got: list[int] = []
        async with client.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": ids,
                "max_tokens": 16,
                "stream": True,
                "return_token_ids": True,
            },
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    for ch in json.loads(line[6:]).get("choices", ()):
                        got.extend(ch.get("token_ids") or ())
        return got

    async def main() -> list[list[int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=bed.proxy_url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(main())
    assert results == [reference(p, 16) for p in prompts]  # 0 lost, 0 duplicated
    assert (
        sum(
            bed.metric("kvcompose_proxy_retries_total", cause=c)
            for c in (
                "stream_dropped",
                "decode_error",
                "recomputed",
                "decode_failed",
                "decode_abort",
            )
        )
        >= 10
    )
    assert not bed.fabric.held


def test_stop_strings_unit():
    s = StopStrings(["abc"], include_in_output=False)
    assert s.feed("xxa", 1) == ("x", None)  # "xa" might start "abc": withheld
    assert s.feed("b", 1) == ("x", None)
    out, match = s.feed("cyy", 1)
    assert out == "" and match is not None and match.stop == "abc"
    assert s.text[: s.emitted] == "xx"
    s = StopStrings(["abc"], include_in_output=True)
    assert s.feed("xxab", 1)[0] == "xxab" and s.feed("cd", 1)[0] == "c"


def test_stop_strings_follow_vllms_detokenizer():
    """``check_stop_strings``: the match that ends first wins, a tie goes to the earlier
    stop string in the list; ``BaseIncrementalDetokenizer.update``: none before more than
    ``min_tokens`` tokens, and none ending in the text of the first ``min_tokens``."""
    s = StopStrings(["abcd", "bc"], include_in_output=False)
    assert s.feed("xabcd", 2)[1] == StopMatch("bc", "xa")  # ends first, starts second
    s = StopStrings(["bc", "abc"], include_in_output=True)
    assert s.feed("xabc", 1)[1] == StopMatch("bc", "xabc")  # a tie: the list's order
    s = StopStrings(["b"], include_in_output=False, min_tokens=2)
    assert s.feed("ab", 1) == ("ab", None)  # token 1 of 2: not checked
    assert s.feed("c", 1) == ("c", None)  # token 2: not checked either
    assert s.feed("b", 1) == ("", StopMatch("b", ""))  # token 3: the first "b" is ignored
    s = StopStrings(["xy"], include_in_output=True, min_tokens=1)
    s.feed("ax", 1)
    assert s.feed("y", 1)[1] == StopMatch("xy", "y")  # starting in token 1, ending after


def test_a_chunk_across_min_tokens_ending_in_ds_stop_is_cut_there():
    """A chunk of several tokens across ``min_tokens`` (vLLM's API server merges the steps a
    busy client has not read yet: ``RequestOutputCollector``) is not checked here, and D's
    verdict cuts it. Before: the chunk was emitted up to the hold, which already held the
    stop string's first character, so the whole stop string reached the client (seen on
    real engines: `` w321 w339`` where vLLM answers `` w321 ``)."""
    s = StopStrings(["w371", "w339"], include_in_output=False, min_tokens=4)
    assert s.feed(" w727 w201", 2) == (" w727 w", None)  # 3 characters held
    _, match = s.feed(" w371 w733 w602 w501 w321 w339", 6, d_stop="w339")
    assert match == StopMatch("w339", "201 w371 w733 w602 w501 w321 ")
    assert s.text[: s.emitted] == " w727 w201 w371 w733 w602 w501 w321 "
    s = StopStrings(["w339"], include_in_output=True, min_tokens=4)
    assert s.feed(" w1 w2 w3 w4 w339", 5, d_stop="w339") == (
        " w1 w2 w3 w4 w339",
        StopMatch("w339", " w1 w2 w3 w4 w339"),
    )


def test_pick_least_outstanding_prefers_backends_not_failed():
    pool = BackendPool.from_urls(["http://p1", "http://p2"], ["http://d1"])
    a, b = pool.prefill
    a.outstanding = 2
    assert pool.pick("prefill") is b
    assert pool.pick("prefill", {b.url}) is a
    pool.mark_failed(a, "x")
    assert pool.pick("prefill", {b.url}) is b  # the only healthy one
    pool.mark_failed(b, "y")
    assert pool.pick("prefill") is a  # none healthy: the one that failed longest ago


def test_slow_health_checks_take_a_backend_out_only_in_a_row():
    """A /health that times out (an engine busy on a loaded machine) is not a dead engine:
    out after ``slow_checks_out`` in a row; a refused or failed check: out at once."""
    pool = BackendPool.from_urls(["http://p1"], ["http://d1"])
    pool.slow_checks_out = 3
    p, d = pool.prefill[0], pool.decode[0]
    answers = {p.url: "slow", d.url: "down"}

    async def check(backend):
        return answers[backend.url]

    asyncio.run(check_all(pool, check))
    assert p.healthy and not d.healthy
    asyncio.run(check_all(pool, check))
    assert p.healthy
    answers.update({p.url: "ok", d.url: "ok"})
    asyncio.run(check_all(pool, check))  # an answer in time resets the count
    assert p.healthy and d.healthy and p.slow_checks == 0
    answers[p.url] = "slow"
    for _ in range(3):
        asyncio.run(check_all(pool, check))
    assert not p.healthy and "3 health checks timed out" in p.last_error
