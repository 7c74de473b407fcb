"""Where the proxy rewrites a request (chat to token ids, stop strings, budgets), its answer
is the one a single vLLM server gives, with and without a retry in between: scripted vLLM
servers that follow vLLM's rules (kvcompose.testing.scripted_vllm); the same requests against
real engines are in test_proxy_engines.py."""

from __future__ import annotations

import logging
import re

import pytest
from polling import eventually
from proxy_sse import stream

from kvcompose.testing.scripted_vllm import MODEL, Fault, chat_ids, detok, reference, tokenize

PROMPT = " ".join(f"w{i}" for i in range(5, 45))
IDS = tokenize(PROMPT)
WANT = reference(IDS, 12)
MESSAGES = [{"role": "user", "content": "w1 w2 w3 w4"}]


def _complete(bed, **body):
    with bed.client() as c:
        return stream(c, "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                             "return_token_ids": True, **body})  # fmt: skip


def _backend_requests(bed):
    return [r for s in bed.all() for r in s.requests]


@pytest.mark.parametrize("drop_after", [None, 3], ids=["one-attempt", "retried"])
def test_chat_without_max_tokens_runs_to_the_context(bed, drop_after):
    """vLLM's chat default (``get_max_tokens`` with no limit of the client's): until EOS or
    ``max_model_len``, also across a retry (it was 16 per attempt, completions' default)."""
    if drop_after is not None:
        bed.decode[0].fail_next(Fault("drop", after=drop_after))
    prompt = chat_ids(MESSAGES)
    n = bed.decode[0].max_model_len - len(prompt)
    with bed.client() as c:
        body = {"model": MODEL, "messages": MESSAGES, "return_token_ids": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        out = stream(c, "/v1/chat/completions", body)
    assert out.status == 200 and out.done and not out.errors, out.body or out.events[-3:]
    assert out.token_ids == reference(prompt, n)
    assert out.usage["completion_tokens"] == n and out.finish["finish_reason"] == "length"


def test_completion_with_null_max_tokens_is_16(bed):
    """``CompletionRequest.normalize_null_max_tokens``: ``max_tokens: null`` is the default."""
    out = _complete(bed, max_tokens=None)
    assert out.token_ids == reference(IDS, 16)


@pytest.mark.parametrize(
    ("drop_after", "steps_per_chunk"),
    [(None, 1), (2, 1), (None, 7)],
    ids=["one-attempt", "retried", "merged-chunks"],
)
def test_min_tokens_come_before_stop_strings(bed, drop_after, steps_per_chunk):
    """``BaseIncrementalDetokenizer.update``: stop strings count only after ``min_tokens``
    tokens. Token 3 completes the first stop string, token 7 the second: with
    ``min_tokens: 4`` vLLM stops at token 7. Also where D sends tokens 1-7 in one chunk (a
    busy API server merges steps), across ``min_tokens`` and ending in D's stop: the stop
    string must not reach the client (it did, seen on real engines)."""
    early, late = f"w{WANT[2]}", f"w{WANT[6]}"
    text = detok(WANT)
    assert text.find(early, len(detok(WANT[:3]))) == -1  # only token 3 completes it
    assert text.find(late) == len(detok(WANT[:6])) + 1  # first completed by token 7
    for d in bed.decode:
        d.steps_per_chunk = steps_per_chunk
    if drop_after is not None:
        bed.decode[0].fail_next(Fault("drop", after=drop_after))
    out = _complete(bed, max_tokens=12, min_tokens=4, stop=[early, late])
    assert out.status == 200 and out.done and not out.errors, out.body or out.events[-3:]
    assert out.finish["finish_reason"] == "stop" and out.finish["stop_reason"] == late
    assert out.token_ids == WANT[:7]
    assert out.text == detok(WANT[:7])[: -len(late)]


@pytest.mark.parametrize("drop_after", [None, 4], ids=["one-attempt", "across-attempts"])
def test_the_stop_string_ending_first_wins(bed, drop_after):
    """``check_stop_strings``: of the stop strings completed at once, the one that ends
    first; a tie goes to the earlier one in the list. Here both end with token 5, the
    longer one starting in token 4 (in another attempt than token 5 when retried)."""
    short, long = f"w{WANT[4]}", f"w{WANT[3]} w{WANT[4]}"
    assert detok(WANT).find(short) == len(detok(WANT[:4])) + 1  # first completed by token 5
    if drop_after is not None:
        bed.decode[0].fail_next(Fault("drop", after=drop_after))
    out = _complete(bed, max_tokens=12, stop=[short, long])
    assert out.finish["finish_reason"] == "stop" and out.finish["stop_reason"] == short
    assert out.text == detok(WANT[:5])[: -len(short)]
    assert out.token_ids == WANT[:5]


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_max_tokens_0_is_a_400_like_vllm(bed, path, field):
    """``SamplingParams._verify_args``: "max_tokens must be at least 1", a 400 naming the
    parameter; nothing reaches a backend."""
    body = {"model": MODEL, field: 0}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})
    with bed.client() as c:
        resp = c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
    assert not _backend_requests(bed)


@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_completion_tokens")],
)
def test_a_limit_above_the_context_is_a_400_like_vllm(bed, path, field):
    """``TokenizeParams.__post_init__``: a limit above ``max_model_len`` is refused, one
    within it but above what the prompt leaves is cut to that (``get_max_tokens``)."""
    context = bed.decode[0].max_model_len
    body = {"model": MODEL, field: context + 1}
    body.update({"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES})
    with bed.client() as c:
        resp = c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == (
        f"{field}={context + 1} cannot be greater than max_model_len={context}. Please "
        f"request fewer output tokens. (parameter={field}, value={context + 1})"
    )
    assert not _backend_requests(bed)
    out = _complete(bed, max_tokens=context)
    assert out.token_ids == reference(IDS, context - len(IDS))
    assert out.finish["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"max_tokens": 3, "min_tokens": 4},
            "min_tokens must be less than or equal to max_tokens=3, got 4.",
        ),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        ({"stop_token_ids": "x"}, "stop_token_ids: Input should be a valid list"),
        ({"stop": 5}, "stop.str: Input should be a valid string"),
    ],
)
def test_fields_the_proxy_reads_are_checked_before_any_backend(bed, body, message):
    """The fields the proxy reads or sends to D alone are checked by the proxy, with vLLM's
    messages; a bad one reaches no backend (a D refusing it would leave P holding a
    hand-off prepared for nothing)."""
    resp = _complete(bed, **body)
    assert resp.status == 400 and resp.body["error"]["message"] == message
    assert not _backend_requests(bed)


def test_fields_left_to_the_backends_are_refused_by_p(bed):
    """Sampling fields the proxy does not read go to P as they are; P's 400 reaches the
    client as it was, and D never sees the request."""
    bed.prefill[0].fail_next(Fault("status", code=400))
    resp = _complete(bed, prompt=IDS, temperature="hot")
    assert resp.status == 400 and "p1: scripted HTTP 400" in resp.body["error"]["message"]
    assert [len(s.requests) for s in bed.all()] == [1, 0, 0, 0]
    assert not bed.fabric.held


def test_every_log_line_names_the_request_and_the_attempt(bed, caplog):
    """Lines of concurrent requests can be told apart: the proxy's say ``req=<id>
    attempt=<k>``, httpx's own per-call INFO lines (no request id) are not logged."""
    caplog.set_level(logging.DEBUG)
    bed.decode[0].fail_next(Fault("load_fail"))  # a retry, and a release of attempt 1
    with bed.client() as c:
        out = stream(c, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                     headers={"X-Request-Id": "logged"})  # fmt: skip
        assert out.done and not out.errors
    assert eventually(lambda: any("released" in r.getMessage() for r in caplog.records))
    mine = [r.getMessage() for r in caplog.records if r.name == "kvcompose.proxy"]
    assert any("decode_error" in m for m in mine)
    assert all(re.match(r"req=logged attempt=\d ", m) for m in mine), mine
    assert not [r for r in caplog.records if r.name.startswith("httpx")]
