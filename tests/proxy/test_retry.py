"""Token-exact retry against scripted vLLM servers: every fault kind, the client's output
equals the scripted model's greedy output, with one id, true usage and no held hand-off."""

from __future__ import annotations

import httpx
import pytest
from polling import eventually
from proxy_sse import stream

from kvcompose.proxy import ProxyConfig, create_app
from kvcompose.testing.scripted_vllm import (
    MODEL,
    Fault,
    ServerThread,
    detok,
    reference,
    tokenize,
)

PROMPT = " ".join(f"w{i}" for i in range(5, 45))
IDS = tokenize(PROMPT)


def _complete(bed, n=12, **extra):
    with bed.client() as c:
        return stream(
            c,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": n,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
                **extra,
            },
        )


def _assert_exact(out, n=12, finish="length"):
    want = reference(IDS, n)
    assert out.status == 200 and out.done and not out.errors, out.events or out.body
    assert out.token_ids == want
    assert out.text == detok(want)
    assert out.finish["finish_reason"] == finish
    assert out.usage == {
        "prompt_tokens": len(IDS),
        "completion_tokens": n,
        "total_tokens": len(IDS) + n,
    }
    assert len({e["id"] for e in out.events}) == 1


def test_plain_handoff(bed):
    out = _complete(bed)
    _assert_exact(out)
    (p_req,) = [r for s in bed.prefill for r in s.requests]
    (d_req,) = [r for s in bed.decode for r in s.requests]
    assert p_req["max_tokens"] == 1 and p_req["kv_transfer_params"] == {"do_remote_decode": True}
    assert p_req["prompt"] == d_req["prompt"] == IDS
    assert d_req["kv_transfer_params"]["remote_request_id"] == p_req["request_id"]
    assert d_req["request_id"] != p_req["request_id"]
    assert not bed.fabric.held
    assert bed.metric("kvcompose_proxy_retries_total", cause="decode_error") == 0


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        (Fault("load_fail"), "decode_error"),
        (Fault("drop", after=5), "stream_dropped"),
        (Fault("recomputed", after=4), "recomputed"),
        (Fault("abort", after=3), "decode_abort"),
        (Fault("status", code=500), "decode_failed"),
        (Fault("drop", after=0), "decode_failed"),  # dropped before D's first event
    ],
)
def test_decode_faults_are_continued_token_exact(bed, fault, cause):
    bed.decode[0].fail_next(fault)  # d1 is picked first; the retry goes to d2
    out = _complete(bed)
    _assert_exact(out)
    assert bed.metric("kvcompose_proxy_retries_total", cause=cause) == 1
    d_reqs = [r for s in bed.decode for r in s.requests if not r.get("use_beam_search")]
    assert len(d_reqs) == 2
    delivered = fault.after if fault.kind in ("drop", "recomputed", "abort") else 0
    # the second attempt: prompt + the ids already delivered, the exact remaining budget
    assert d_reqs[1]["prompt"] == IDS + reference(IDS, delivered)
    assert d_reqs[1]["max_tokens"] == 12 - delivered
    assert d_reqs[1]["request_id"].endswith("-2-d")
    # a hand-off D failed before its first token (no event, or an error first) is released
    # through a decode engine: D may never have read P's blocks
    releases = [r for s in bed.decode for r in s.requests if r.get("use_beam_search")]
    assert len(releases) == (delivered == 0)
    assert bool(bed.fabric.released) == (fault.kind == "status")  # D had not pulled it
    assert not bed.fabric.held


def test_chat_stream_is_seamless_across_a_drop(bed):
    bed.decode[0].fail_next(Fault("drop", after=3))
    bed.decode[1].fail_next(Fault("drop", after=3))
    messages = [{"role": "user", "content": "w1 w2 w3 w4"}]
    with bed.client() as c:
        out = stream(
            c,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": messages,
                "max_completion_tokens": 9,
                "stream_options": {"include_usage": True},
            },
        )
    prompt = [1002, 1, 2, 3, 4, 1003]
    assert out.status == 200 and out.done
    roles = [c for c in out.chunks if c["choices"][0]["delta"].get("role")]
    assert len(roles) == 1 and out.chunks[0] is roles[0]
    assert out.text == detok(reference(prompt, 9))
    assert out.finish["finish_reason"] == "length"
    assert out.usage["completion_tokens"] == 9 and out.usage["prompt_tokens"] == len(prompt)
    assert {e["object"] for e in out.events} == {"chat.completion.chunk"}


def test_non_streamed_answer_after_faults(bed):
    bed.decode[0].fail_next(Fault("load_fail"))
    bed.decode[1].fail_next(Fault("recomputed", after=2))
    with bed.client() as c:
        resp = c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "return_token_ids": True},
        )
    data = resp.json()
    assert resp.status_code == 200, data
    choice = data["choices"][0]
    assert choice["token_ids"] == reference(IDS, 10) and choice["text"] == detok(reference(IDS, 10))
    assert data["usage"]["completion_tokens"] == 10
    assert data["object"] == "text_completion"


def test_budget_exhausted_by_delivered_tokens_finishes_with_length(bed):
    bed.decode[0].fail_next(Fault("recomputed", after=6))
    bed.decode[1].fail_next(Fault("recomputed", after=6))
    out = _complete(bed, n=6)
    # 6 tokens came before the give-back: nothing is left to ask for, no second attempt
    _assert_exact(out, n=6)
    assert len([r for s in bed.decode for r in s.requests]) == 1


def test_stop_string_across_attempts(bed):
    want = reference(IDS, 12)
    stop = f"w{want[3]} w{want[4]}"  # tokens 4 and 5: the drop falls between them
    for d in bed.decode:
        d.fail_next(Fault("drop", after=4))
    out = _complete(bed, stop=[stop])
    assert out.finish["finish_reason"] == "stop" and out.finish["stop_reason"] == stop
    assert out.text == detok(want[:5])[: -len(stop)]
    assert out.token_ids == want[:5]
    out = _complete(bed, stop=[stop], include_stop_str_in_output=True)
    assert out.text == detok(want[:5])


def test_prefill_down_retries_on_the_other_prefill(bed):
    bed.prefill[0].fail_next(Fault("status", code=503))
    out = _complete(bed, prompt=IDS)  # token ids: no /tokenize call, p1 is picked first
    _assert_exact(out)
    assert bed.metric("kvcompose_proxy_retries_total", cause="prefill_failed") == 1
    p_urls = [s.name for s in bed.prefill if s.requests]
    assert sorted(p_urls) == ["p1", "p2"]  # the second attempt went to the other P


def test_gives_up_with_a_clear_error(bed):
    for d in bed.decode:
        d.fail_next(*[Fault("load_fail")] * 4)
    with bed.client() as c:
        resp = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5})
    assert resp.status_code == 503
    msg = resp.json()["error"]["message"]
    assert "gave up after 4 attempts" in msg and "decode" in msg
    assert not bed.fabric.held
    # streamed: tokens already sent, then an error event and [DONE]
    for d in bed.decode:
        d.faults.clear()
    bed.decode[0].fail_next(Fault("drop", after=2), *[Fault("load_fail")] * 3)
    bed.decode[1].fail_next(*[Fault("load_fail")] * 4)
    out = _complete(bed, n=8)
    assert out.status == 200 and out.done
    assert out.token_ids == reference(IDS, 2)
    assert "gave up after 4 attempts" in out.errors[0]["message"]


def test_prefill_killed_before_the_decode_is_retried_on_the_other_prefill(bed):
    """p1 answers the prefill and dies before D pulls: its blocks are gone (D's load fails,
    as NIXL's read from a dead engine does) and p1 refuses what follows. The next attempt
    prefills on p2 at once: a hand-off D failed before its first token counts against P."""
    p1 = bed.prefill[0]

    async def kill_p1(response: httpx.Response) -> None:
        req = response.request
        if p1.faults or req.method != "POST" or not str(req.url).startswith(bed.urls["p1"]):
            return
        await response.aread()
        params = response.json().get("kv_transfer_params")
        if params:
            bed.fabric.pull(params["remote_request_id"])  # P's memory went with it
            p1.healthy = False
            p1.fail_next(*[Fault("status", code=503)] * 8)

    client = httpx.AsyncClient(event_hooks={"response": [kill_p1]})
    app = create_app(
        ProxyConfig(
            prefill=[bed.urls["p1"], bed.urls["p2"]],
            decode=[bed.urls["d1"], bed.urls["d2"]],
            backoff_s=0.01,
            health_interval_s=60,  # no health check between the attempts
        ),
        http_client=client,
    )
    app.state.pool.prefill[1].served = 10  # p2 looks busier: only the rule sends attempt 2 there
    bed.app = app
    proxy = ServerThread(app).start()
    bed.proxy_url = proxy.url
    try:
        out = _complete(bed, prompt=IDS)
    finally:
        proxy.stop()
    _assert_exact(out)
    assert bed.metric("kvcompose_proxy_retries_total", cause="decode_error") == 1
    assert bed.metric("kvcompose_proxy_retries_total", cause="prefill_failed") == 0
    assert [len(p.requests) for p in bed.prefill] == [1, 1]
    assert not bed.fabric.held


def test_decode_refusing_the_request_releases_the_handoff(bed):
    """A 4xx from D is the request's fault and goes to the client as it was; P's hand-off,
    prepared for nothing, is released at once instead of waiting for P's lease."""
    bed.decode[0].fail_next(Fault("status", code=400))
    with bed.client() as c:
        resp = c.post("/v1/completions", json={"model": MODEL, "prompt": IDS, "max_tokens": 4})
    assert resp.status_code == 400 and "scripted HTTP 400" in resp.json()["error"]["message"]
    assert eventually(lambda: bed.fabric.released) and not bed.fabric.held
