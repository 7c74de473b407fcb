"""A scripted stand-in for vLLM's OpenAI server in a P/D pair, with faults a test controls.

It answers what the proxy calls, in vLLM 0.32's shapes: ``/tokenize`` (``serve/tokenize``),
``/v1/completions`` as prefill (non-streamed, ``kv_transfer_params`` on the response,
``completion/protocol.py``, ``CompletionResponse``) and as decode (SSE chunks with
``token_ids`` and ``stop_reason``; a generation error is a ``data: {"error": ...}`` event
then ``[DONE]``: ``OpenAIServingCompletion.completion_stream_generator``), the hand-off
rejection of ``_with_kv_transfer_rejection_cleanup`` (``generate/base/serving.py``),
``/health`` and ``/v1/models``; the budget (``get_max_tokens``) and stop-string rules
(``check_stop_strings``) of vLLM, and its abort of a request whose client left
(``with_cancellation``). The faults imitate
what the proxy must survive: a 5xx, a KV load failure (vLLM's ``kv_load_failure_policy:
fail``), vllm-ascend's recompute scheduler giving a request back (``finish_reason: "stop"``,
``stop_reason: "recomputed"``, no tokens: ``vllm_ascend/core/recompute_scheduler.py``,
``update_from_output``), a connection dropped mid-stream, a stall.

The "model" is a deterministic function of the whole token sequence, so greedy output is
well defined: :func:`reference` is what one engine produces in one go. A :class:`Fabric`
plays NIXL: P keeps a hand-off's "blocks" until a D pulls them or is told to release them,
and a D pulling blocks that are gone fails the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvcompose.sse import SSEResponse

MODEL = "scripted-tiny"
ROLE_IDS = {"system": 1001, "user": 1002, "assistant": 1003}


def next_token(seq: list[int]) -> int:
    a, b = seq[-1] if seq else 0, seq[-2] if len(seq) > 1 else 0
    return (a * 7 + b * 13 + len(seq) * 3 + 11) % 997 + 3


def reference(prompt_ids: list[int], n: int) -> list[int]:
    """Greedy output of the scripted model: what a single engine would produce."""
    seq = list(prompt_ids)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt_ids) :]


def detok(ids: list[int]) -> str:
    return "".join(f" w{t}" for t in ids)


def tokenize(text: str) -> list[int]:
    return [
        int(w[1:])
        if w[:1] == "w" and w[1:].isdigit()
        else int(hashlib.sha1(w.encode()).hexdigest(), 16) % 997 + 3
        for w in text.split()
    ]


def chat_ids(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [ROLE_IDS.get(m.get("role", "user"), 1002), *tokenize(str(m.get("content", "")))]
    return ids + ([ROLE_IDS["assistant"]] if add_generation_prompt else [])


@dataclass
class Fabric:
    """Hand-offs P holds (NIXL's ``_reqs_to_send``), by remote request id."""

    held: dict[str, list[int]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, rid: str, prompt: list[int]) -> None:
        with self.lock:
            self.held[rid] = list(prompt)

    def pull(self, rid: str) -> list[int] | None:
        with self.lock:
            return self.held.pop(rid, None)

    def release(self, rid: str) -> None:
        with self.lock:
            if self.held.pop(rid, None) is not None:
                self.released.append(rid)


@dataclass
class Fault:
    """``kind``: "status" (answer ``code``), "load_fail", "recomputed" (after ``after``
    tokens), "drop" (close the connection after ``after`` tokens), "abort" (finish_reason
    abort after ``after`` tokens), "delay" (wait ``seconds`` first, then serve),
    "slow_answer" (a prefill: its status line at once, its body ``seconds`` later; vLLM
    sends both together once the prefill is over, a slow network can part them)."""

    kind: str
    after: int = 0
    code: int = 500
    seconds: float = 0.0


class ScriptedVLLM:
    """One scripted server (P or D: the request's ``kv_transfer_params`` decide)."""

    def __init__(self, name: str, fabric: Fabric, token_delay: float = 0.0,
                 max_model_len: int = 4096) -> None:  # fmt: skip
        self.name = name
        self.max_model_len = max_model_len
        self.fabric = fabric
        self.token_delay = token_delay
        self.faults: list[Fault] = []
        #: engine steps per decode chunk: vLLM's API server merges the steps its client has
        #: not read yet into one chunk (``RequestOutputCollector.put``, delta outputs)
        self.steps_per_chunk = 1
        self.requests: list[dict[str, Any]] = []
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.healthy = True
        self.app = self._build()

    def fail_next(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def _take_fault(self) -> Fault | None:
        return self.faults.pop(0) if self.faults else None

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({}, status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": MODEL,
                            "object": "model",
                            "owned_by": "vllm",
                            "max_model_len": self.max_model_len,
                        }
                    ],
                }
            )

        @app.post("/tokenize")
        async def tok(request: Request) -> JSONResponse:
            body = await request.json()
            if "messages" in body:
                ids = chat_ids(body["messages"], body.get("add_generation_prompt", True))
            else:
                ids = tokenize(body["prompt"])
            return JSONResponse(
                {
                    "count": len(ids),
                    "max_model_len": self.max_model_len,
                    "tokens": ids,
                    "token_strs": None,
                }
            )

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            params = body.get("kv_transfer_params") or {}
            rid = body.get("request_id") or uuid.uuid4().hex
            if (
                params.get("do_remote_prefill")
                and body.get("stream")
                and body.get("use_beam_search")
            ):
                # _with_kv_transfer_rejection_cleanup + NIXL's request_finished
                self.fabric.release(params["remote_request_id"])
                return _err("Streaming is not currently supported with beam search", 400)
            fault = self._take_fault()
            if fault is not None and fault.kind == "delay":
                # vLLM's routes run under ``with_cancellation``: a client that disconnects
                # meanwhile aborts the request (and NIXL frees an aborted prefill at once)
                if await _client_left_within(request, fault.seconds):
                    self.aborted.append(rid)
                    return _err("aborted", 499)
                fault = None
            budget = _max_tokens(body, len(body["prompt"]), self.max_model_len)
            if isinstance(budget, JSONResponse):
                return budget
            body["max_tokens"] = budget
            if fault is not None and fault.kind == "status":
                return _err(f"{self.name}: scripted HTTP {fault.code}", fault.code)
            prompt = body["prompt"]
            if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
                return _err("the scripted server takes token-id prompts only", 400)
            if params.get("do_remote_decode"):
                answer = self._prefill(rid, prompt)
                if fault is not None and fault.kind == "slow_answer":
                    return _slowly(answer, fault.seconds)
                return answer
            return SSEResponse(
                self._decode(rid, body, params, fault), media_type="text/event-stream"
            )

        return app

    def _prefill(self, rid: str, prompt: list[int]) -> JSONResponse:
        handoff = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": self.name,
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_num_tokens": len(prompt),
            "transfer_mode": "pull",
        }
        self.fabric.hold(rid, prompt)
        first = reference(prompt, 1)
        return JSONResponse(
            {
                "id": f"cmpl-{rid}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": detok(first),
                        "finish_reason": "length",
                        "stop_reason": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 1,
                    "total_tokens": len(prompt) + 1,
                },
                "kv_transfer_params": handoff,
            }
        )

    async def _decode(
        self, rid: str, body: dict[str, Any], params: dict[str, Any], fault: Fault | None
    ) -> Any:
        prompt: list[int] = body["prompt"]
        max_tokens = body["max_tokens"]
        stops = body.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        min_tokens = body.get("min_tokens") or 0
        self.active.add(rid)
        finished = False
        try:
            if params.get("do_remote_prefill"):
                pulled = self.fabric.pull(params.get("remote_request_id", ""))
                if pulled != prompt or (fault is not None and fault.kind == "load_fail"):
                    # the engine ends the request with FINISHED_ERROR -> GenerationError
                    yield _data(
                        {
                            "error": {
                                "message": "Internal server error",
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                    )
                    yield "data: [DONE]\n\n"
                    finished = True
                    return
            seq, text = list(prompt), ""
            pieces, toks = "", []  # steps not sent yet (``steps_per_chunk``)
            for i in range(max_tokens):
                if fault is not None and i == fault.after:
                    if fault.kind == "drop":
                        raise RuntimeError("scripted: connection dropped mid-stream")
                    if fault.kind in ("recomputed", "abort"):
                        reason = "stop" if fault.kind == "recomputed" else "abort"
                        stop = "recomputed" if fault.kind == "recomputed" else None
                        yield _data(_chunk(rid, "", [], reason, stop, body))
                        yield "data: [DONE]\n\n"
                        finished = True
                        return
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                tok = next_token(seq)
                seq.append(tok)
                piece = detok([tok])
                text += piece
                hit = _stop_string(text, len(piece), stops, i + 1, min_tokens)
                last = i == max_tokens - 1
                reason = "stop" if hit else ("length" if last else None)
                pieces, toks = pieces + piece, [*toks, tok]
                if reason or len(toks) == self.steps_per_chunk:
                    yield _data(_chunk(rid, pieces, toks, reason, hit, body))
                    pieces, toks = "", []
                if reason:
                    break
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(seq) - len(prompt),
                "total_tokens": len(seq),
            }
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _data(
                    {
                        "id": f"cmpl-{rid}",
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": MODEL,
                        "choices": [],
                        "usage": usage,
                    }
                )
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            self.active.discard(rid)
            if not finished:
                self.aborted.append(rid)


def _slowly(answer: JSONResponse, seconds: float) -> StreamingResponse:
    async def body() -> Any:
        await asyncio.sleep(seconds)  # the status line went first
        yield answer.body

    return StreamingResponse(body(), media_type="application/json")


def _max_tokens(body: dict[str, Any], prompt_len: int, max_model_len: int) -> Any:
    """vLLM's budget for a completion: ``CompletionRequest.normalize_null_max_tokens`` (no
    limit or null: 16), ``TokenizeParams.__post_init__`` (no limit above the context),
    ``get_max_tokens`` (no more than the context leaves),
    ``SamplingParams._verify_args`` (at least 1; ``min_tokens`` no more than that). A
    ``JSONResponse`` (400) when refused."""
    asked = 16 if body.get("max_tokens") is None else body["max_tokens"]
    if asked > max_model_len:  # TokenizeParams.__post_init__
        return _err(f"max_tokens={asked} cannot be greater than max_model_len={max_model_len}. "
                    f"Please request fewer output tokens. (parameter=max_tokens, value={asked})",
                    400)  # fmt: skip
    budget = min(asked, max_model_len - prompt_len)
    if budget < 1:
        return _err(f"max_tokens must be at least 1, got {budget}. "
                    f"(parameter=max_tokens, value={budget})", 400)  # fmt: skip
    if (body.get("min_tokens") or 0) > budget:
        return _err(f"min_tokens must be less than or equal to max_tokens={budget}, "
                    f"got {body['min_tokens']}.", 400)  # fmt: skip
    return budget


def _stop_string(text: str, new_chars: int, stops: list[str], generated: int,
                 min_tokens: int) -> str | None:  # fmt: skip
    """vLLM's rule for one new token (``BaseIncrementalDetokenizer.update`` and
    ``check_stop_strings`` in ``v1/engine/detokenizer.py``): no stop string until more than
    ``min_tokens`` tokens; then the match completed by the new text that ends first, ties
    to the earlier stop string in the list."""
    if generated <= min_tokens:
        return None
    best, best_end = None, len(text) + 1
    for stop in stops:
        i = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if i >= 0 and i + len(stop) < best_end:
            best, best_end = stop, i + len(stop)
    return best


async def _client_left_within(request: Request, seconds: float) -> bool:
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(disconnected(), seconds)
    except TimeoutError:
        return False
    return True


def _chunk(
    rid: str, text: str, ids: list[int], finish: str | None, stop: Any, body: dict[str, Any]
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = ids
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [choice],
    }


def _data(obj: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(obj)}\n\n"


def _err(message: str, status: int) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


class ServerThread:
    """An ASGI app served by uvicorn on 127.0.0.1 in a thread of its own."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(RuntimeError):
            self.thread.join(timeout=10)
