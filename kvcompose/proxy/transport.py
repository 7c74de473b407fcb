"""Talking to one vLLM OpenAI server over HTTP (httpx): the backend side of the proxy.

Every failure comes out as a :class:`BackendError` that says whether the backend is at fault
(unreachable, timed out, 5xx, a broken stream: retry elsewhere) or the request is (4xx:
pass the backend's answer to the client). The shapes parsed here are vLLM 0.32's:
``vllm/entrypoints/openai/completion/serving.py`` (``OpenAIServingCompletion.
completion_stream_generator``: the stream chunks, the usage chunk, and a generation error
mid-stream as one ``data: {"error": ...}`` event and then ``[DONE]``) and
``completion/protocol.py`` (``CompletionStreamResponse``, ``kv_transfer_params`` on
``CompletionResponse``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvcompose.proxy.backends import Backend, Health
from kvcompose.proxy.config import Timeouts

ErrorKind = Literal["unreachable", "timeout", "status", "stream", "protocol"]


class BackendError(Exception):
    def __init__(
        self, backend: Backend, kind: ErrorKind, message: str, status: int | None = None,
        body: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(f"{backend.role} {backend.url}: {message}")
        self.backend = backend
        self.kind = kind
        self.status = status
        self.body = body

    @property
    def client_error(self) -> bool:
        """The backend rejected the request itself (4xx): retrying elsewhere will not help."""
        return self.kind == "status" and self.status is not None and 400 <= self.status < 500


@dataclass
class Tokenized:
    ids: list[int]
    max_model_len: int | None  # the context length the backend reports


@dataclass
class StreamEvent:
    """One choice of one chunk of D's stream (or a streamed error)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: dict[str, Any] | None = None


class Transport:
    """The HTTP calls the proxy makes; ``client`` is shared by all requests (its pool keeps
    connections to the backends open)."""

    def __init__(self, client: httpx.AsyncClient, timeouts: Timeouts) -> None:
        self.client = client
        self.timeouts = timeouts
        self._timeout = httpx.Timeout(timeouts.read, connect=timeouts.connect)

    async def _post_json(self, backend: Backend, path: str, body: dict[str, Any],
                         answering: asyncio.Event | None = None) -> Any:  # fmt: skip
        """POST ``body``, return the JSON answer; ``answering`` is set once the answer's
        status line arrived (vLLM sends it only when the request is over)."""
        try:
            async with self.client.stream("POST", f"{backend.url}{path}", json=body,
                                          timeout=self._timeout) as resp:  # fmt: skip
                if answering is not None:
                    answering.set()
                await resp.aread()
        except httpx.TimeoutException as exc:
            raise BackendError(backend, "timeout", f"{path}: timed out ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise BackendError(backend, "unreachable", f"{path}: {exc!r}") from exc
        data = _json_or_text(resp)
        if resp.status_code != 200:
            raise BackendError(backend, "status", f"{path}: HTTP {resp.status_code}: "
                               f"{_error_message(data)}", resp.status_code, data)  # fmt: skip
        return data

    async def health(self, backend: Backend) -> Health:
        """``ok``; ``slow`` when no answer came within the health timeout (a busy engine);
        ``down`` when refused, reset or answered with an error status."""
        try:
            resp = await self.client.get(f"{backend.url}/health", timeout=self.timeouts.health)
        except httpx.TimeoutException:
            return "slow"
        except httpx.HTTPError:
            return "down"
        return "ok" if resp.status_code == 200 else "down"

    async def models(self, backend: Backend) -> list[dict[str, Any]]:
        try:
            resp = await self.client.get(f"{backend.url}/v1/models", timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise BackendError(backend, "unreachable", f"/v1/models: {exc!r}") from exc
        if resp.status_code != 200:
            raise BackendError(backend, "status", f"/v1/models: HTTP {resp.status_code}",
                               resp.status_code)  # fmt: skip
        return list(resp.json().get("data", []))

    async def tokenize(self, backend: Backend, body: dict[str, Any]) -> Tokenized:
        """vLLM's ``/tokenize`` (``serve/tokenize/protocol.py``): a completion prompt, or chat
        ``messages`` with the chat template applied; the answer's ``tokens`` and
        ``max_model_len``."""
        data = await self._post_json(backend, "/tokenize", body)
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise BackendError(backend, "protocol", f"/tokenize answered without tokens: {data}")
        context = data.get("max_model_len")
        return Tokenized([int(t) for t in tokens], context if isinstance(context, int) else None)

    async def prefill(self, backend: Backend, body: dict[str, Any],
                      answering: asyncio.Event | None = None) -> dict[str, Any]:  # fmt: skip
        """Run the prefill; return the ``kv_transfer_params`` P hands to D. ``answering`` is
        set when P's answer begins: from then on P holds the hand-off's blocks."""
        data = await self._post_json(backend, "/v1/completions", body, answering)
        params = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(params, dict):
            raise BackendError(
                backend,
                "protocol",
                "the prefill answer carries no "
                "kv_transfer_params (is P started with a P/D connector?)",
            )
        return params

    async def decode(self, backend: Backend, body: dict[str, Any]) -> AsyncIterator[StreamEvent]:
        """Stream D's answer. Closing the iterator early closes the connection, and vLLM
        aborts a streamed request whose client went away."""
        url = f"{backend.url}/v1/completions"
        try:
            async with self.client.stream("POST", url, json=body, timeout=self._timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    data = _json_or_text(resp)
                    raise BackendError(
                        backend,
                        "status",
                        f"decode: HTTP {resp.status_code}: {_error_message(data)}",
                        resp.status_code,
                        data,
                    )
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    for event in _events(json.loads(payload)):
                        yield event
        except httpx.TimeoutException as exc:
            raise BackendError(backend, "timeout", f"decode: timed out ({exc!r})") from exc
        except httpx.HTTPError as exc:
            raise BackendError(backend, "stream", f"decode: {exc!r}") from exc
        except json.JSONDecodeError as exc:
            raise BackendError(backend, "protocol", f"decode: bad chunk ({exc})") from exc

    async def release(self, backend: Backend, params: dict[str, Any], request_id: str) -> int:
        """Make decode engine ``backend`` reject a hand-off, so its connector frees P's blocks.

        vLLM 0.32 wraps ``create_completion`` in ``_with_kv_transfer_rejection_cleanup``
        (``entrypoints/generate/base/serving.py``): a request carrying
        ``do_remote_prefill`` that ends in an ``ErrorResponse`` before reaching the engine
        is submitted pre-aborted (``AsyncLLM.notify_kv_transfer_request_rejected``), and
        NIXL's ``request_finished`` on D then queues the notification that makes P free the
        blocks (its ``do_remote_prefill`` branch). ``stream`` with ``use_beam_search`` is
        such an error (``OpenAIServingCompletion._create_completion``'s first check):
        nothing is read or computed.
        Returns the HTTP status (400 expected)."""
        body = {
            "prompt": [0],
            "max_tokens": 1,
            "stream": True,
            "use_beam_search": True,
            "request_id": request_id,
            "kv_transfer_params": params,
        }
        try:
            resp = await self.client.post(f"{backend.url}/v1/completions", json=body,
                                          timeout=self._timeout)  # fmt: skip
        except httpx.HTTPError as exc:
            raise BackendError(backend, "unreachable", f"release: {exc!r}") from exc
        return resp.status_code


def _events(chunk: dict[str, Any]) -> list[StreamEvent]:
    if "error" in chunk:
        err = chunk["error"]
        return [StreamEvent(error=err if isinstance(err, dict) else {"message": str(err)})]
    out = []
    for choice in chunk.get("choices") or ():
        out.append(StreamEvent(
            token_ids=list(choice.get("token_ids") or ()),
            text=choice.get("text") or "",
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
        ))  # fmt: skip
    return out


def _json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text


def _error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(data)[:500]
