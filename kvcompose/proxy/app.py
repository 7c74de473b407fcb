"""The HTTP front (FastAPI): ``create_app(config)`` is the ASGI app ``kvcompose proxy`` serves.

    uvicorn --factory 'kvcompose.proxy.app:app_from_env'   # KVCOMPOSE_PROXY_CONFIG=proxy.yaml

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/health`` (200 while at least one prefill and one decode engine are in rotation),
``/metrics`` (Prometheus). Nothing a client sends makes the app raise: bad input is a 400,
an unknown model a 404, backends that cannot serve a 503 naming them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvcompose.config.errors import ConfigError
from kvcompose.proxy.backends import BackendPool, check_all, health_loop
from kvcompose.proxy.config import ProxyConfig, load_proxy_config
from kvcompose.proxy.core import Delta, Finish, GenerationFailed, Router
from kvcompose.proxy.metrics import ProxyMetrics
from kvcompose.proxy.openai_api import (
    BadRequest,
    ChatBody,
    CompletionBody,
    Formatter,
    Kind,
    error_body,
    generation_request,
)
from kvcompose.proxy.transport import BackendError, Transport
from kvcompose.sse import SSEResponse

log = logging.getLogger("kvcompose.proxy")
T = TypeVar("T")


def create_app(config: ProxyConfig, *, http_client: httpx.AsyncClient | None = None) -> FastAPI:
    """The proxy as an ASGI app. ``http_client``: the client for backend calls (default: one
    with pooled connections, owned by the app)."""
    _quiet_httpx()
    metrics = ProxyMetrics()
    pool = BackendPool.from_urls(config.prefill, config.decode)
    pool.on_change = metrics.backend_changed
    pool.slow_checks_out = config.health_timeouts_out
    for backend in pool.all():
        metrics.backend_changed(backend)
    state: dict[str, Any] = {"models": []}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = http_client or httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=256,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
        )
        transport = Transport(client, config.timeouts)
        router = Router(config, pool, transport, metrics)
        app.state.router = router
        await check_all(pool, transport.health)
        await _refresh_models(router, state)
        task = asyncio.create_task(_monitor(router, state))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.drain()
            if http_client is None:
                await client.aclose()

    app = FastAPI(title="kvcompose proxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.pool = pool
    app.state.metrics = metrics

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)
        return JSONResponse(error_body(f"proxy error: {exc!r}", 500), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = {role: [b.url for b in pool.of(role) if b.healthy] for role in ("prefill", "decode")}
        down = {role: [b.url for b in pool.of(role) if not b.healthy]
                for role in ("prefill", "decode")}  # fmt: skip
        ok = bool(up["prefill"] and up["decode"])
        return JSONResponse({"healthy": ok, "up": up, "down": down},
                            status_code=200 if ok else 503)  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        if not state["models"]:
            await _refresh_models(request.app.state.router, state)
        if not state["models"]:
            return _error("no backend answered /v1/models", 503)
        return JSONResponse({"object": "list", "data": state["models"]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(request, "completion", state)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve(request, "chat", state)

    return app


def _quiet_httpx() -> None:
    """httpx logs every backend call at INFO (``HTTP Request: POST http://...``) with nothing
    that ties it to a client request, twice per attempt; the proxy's own lines say
    ``req=<id> attempt=<k>``. Unless a level was set for httpx's logger, its INFO lines go
    (its warnings stay)."""
    httpx_log = logging.getLogger("httpx")
    if httpx_log.level == logging.NOTSET:
        httpx_log.setLevel(logging.WARNING)


def app_from_env() -> FastAPI:
    """For ``uvicorn --factory``: the config file named by ``KVCOMPOSE_PROXY_CONFIG`` (unset,
    or a bad file, is a ``ConfigError`` saying so, which uvicorn prints)."""
    path = os.environ.get("KVCOMPOSE_PROXY_CONFIG")
    if not path:
        raise ConfigError("KVCOMPOSE_PROXY_CONFIG is not set: name the proxy's settings file")
    return create_app(load_proxy_config(path))


async def _monitor(router: Router, state: dict[str, Any]) -> None:
    async def models_when_missing() -> None:
        while True:
            if not state["models"]:
                await _refresh_models(router, state)
            await asyncio.sleep(router.config.health_interval_s)

    async with anyio.create_task_group() as tg:
        tg.start_soon(health_loop, router.pool, router.transport.health,
                      router.config.health_interval_s)  # fmt: skip
        tg.start_soon(models_when_missing)


async def _refresh_models(router: Router, state: dict[str, Any]) -> None:
    for backend in [*router.pool.decode, *router.pool.prefill]:
        if not backend.healthy:
            continue
        try:
            data = await router.transport.models(backend)
        except BackendError as exc:
            log.warning("models: %s", exc)
            continue
        if router.config.model:
            data = [m for m in data if m.get("id") == router.config.model] or [
                {"id": router.config.model, "object": "model", "owned_by": "kvcompose"}
            ]
        state["models"] = data
        return


def _error(message: str, status: int, param: str | None = None, body: Any = None) -> JSONResponse:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return JSONResponse(body, status_code=status)  # the backend's own error, as it was
    return JSONResponse(error_body(message, status, param=param), status_code=status)


#: Seconds an idle backend connection stays in the pool. vLLM's server closes one after
#: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by default), httpx's default expiry is also 5 s: a
#: request sent on a connection the server is closing that moment fails (``ReadError``),
#: which takes a healthy P out of rotation and costs the request an attempt (a prefill's
#: ``ReadError('')`` after some idle seconds, once among 64 concurrent clients, most likely
#: this). Dropping idle connections well before the server does avoids the race.
KEEPALIVE_EXPIRY_S = 2.0

#: The largest request body read (a prompt of a million token ids is about 8 MB); a larger
#: one is refused with 413 before it is held whole in memory.
MAX_BODY_BYTES = 32 * 1024 * 1024


async def _body(request: Request) -> bytes:
    too_large = BadRequest(
        f"the request body is larger than {MAX_BODY_BYTES // (1 << 20)} MiB", status=413
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # also a chunked body with no length
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, kind: Kind) -> CompletionBody | ChatBody:
    try:
        raw = json.loads(await _body(request))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise BadRequest("the request body is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise BadRequest("the request body must be a JSON object")
    model = ChatBody if kind == "chat" else CompletionBody
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"{where}: {first['msg']}", where or None) from exc
    body.check()
    return body


async def _serve(request: Request, kind: Kind, state: dict[str, Any]) -> Response:
    router: Router = request.app.state.router
    endpoint = "chat" if kind == "chat" else "completions"
    rid = (
        request.headers.get("X-Request-Id")
        or f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    )
    try:
        body = await _parse(request, kind)
        model = _model_for(body.model, state, router)
        tok = body.tokenize_body(model)
        if tok is not None:
            tokenized = await router.tokenize(tok, rid)
            prompt_ids, context = tokenized.ids, tokenized.max_model_len
        else:
            prompt_ids, context = list(body.prompt), None
        context = _max_model_len(model, state) or context
        req = generation_request(body, rid, model, prompt_ids, context)
    except BadRequest as exc:
        router.metrics.requests.labels(endpoint=endpoint, outcome="bad_request").inc()
        return _error(exc.message, exc.status, exc.param)
    except GenerationFailed as exc:
        router.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return _error(exc.message, exc.status, body=exc.body)
    fmt = Formatter(kind, rid, model, body.return_token_ids, prompt_ids)
    if body.stream:
        return await _stream(router, req, fmt, body.include_usage(), endpoint, request)
    return await _whole(router, req, fmt, endpoint, request)


def _max_model_len(model: str, state: dict[str, Any]) -> int | None:
    """The context length the backends report for ``model`` (vLLM's ``/v1/models`` cards
    carry ``max_model_len``)."""
    for card in state["models"]:
        if card.get("id") == model and isinstance(card.get("max_model_len"), int):
            return int(card["max_model_len"])
    return None


def _model_for(asked: str | None, state: dict[str, Any], router: Router) -> str:
    served = [m.get("id") for m in state["models"]]
    if asked is None:
        if router.config.model or served:
            return router.config.model or served[0]
        raise BadRequest("no backend has told which model it serves yet", status=503)
    if served and asked not in served:
        raise BadRequest(f"The model `{asked}` does not exist.", "model", status=404)
    return asked


async def _whole(router: Router, req: Any, fmt: Formatter, endpoint: str,
                 request: Request) -> Response:  # fmt: skip
    async def collect() -> tuple[str, list[int], Finish]:
        text, ids = [], []
        async with contextlib.aclosing(router.generate(req)) as events:
            async for ev in events:
                if isinstance(ev, Delta):
                    text.append(ev.text)
                    ids.extend(ev.token_ids)
                else:
                    return "".join(text), ids, ev
        raise GenerationFailed(500, "generation ended without a finish")

    router.metrics.in_flight.inc()
    try:
        finished, result = await _unless_client_leaves(request, collect())
        if not finished:  # the client left: the backends' work was stopped
            router.metrics.requests.labels(endpoint=endpoint, outcome="disconnected").inc()
            return Response(status_code=499)
        try:
            text, ids, finish = result.result()
        except GenerationFailed as exc:
            router.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
            return _error(exc.message, exc.status, body=exc.body)
        router.metrics.requests.labels(endpoint=endpoint, outcome="ok").inc()
        return JSONResponse(fmt.response(text, ids, finish))
    finally:
        router.metrics.in_flight.dec()


async def _unless_client_leaves(
    request: Request, work: Awaitable[T]
) -> tuple[bool, asyncio.Future[T]]:
    """Run ``work`` until it ends or the client disconnects, whichever comes first (as
    vLLM's ``with_cancellation`` does for its routes); when the client leaves, ``work`` is
    cancelled, which closes the backend requests it has open. Returns (ended, its task)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return True, task
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return False, task


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(router: Router, req: Any, fmt: Formatter, include_usage: bool,
                  endpoint: str, request: Request) -> Response:  # fmt: skip
    """Waits for the first event before answering, so a request that cannot start at all
    gets a status code (503) rather than an empty 200 stream; a client leaving meanwhile
    (during P's prefill) stops the request there: P is aborted, D never sees it."""
    events = router.generate(req)
    router.metrics.in_flight.inc()
    try:
        finished, first_event = await _unless_client_leaves(request, anext(events))
        if not finished:
            await events.aclose()
            router.metrics.in_flight.dec()
            router.metrics.requests.labels(endpoint=endpoint, outcome="disconnected").inc()
            return Response(status_code=499)
        first = first_event.result()
    except GenerationFailed as exc:
        router.metrics.in_flight.dec()
        router.metrics.requests.labels(endpoint=endpoint, outcome="failed").inc()
        return _error(exc.message, exc.status, body=exc.body)
    except BaseException:
        router.metrics.in_flight.dec()
        await events.aclose()
        raise

    async def sse() -> AsyncIterator[str]:
        outcome = "disconnected"
        try:
            role = fmt.role_chunk()
            if role is not None:
                yield _data(role)
            ev: Delta | Finish | None = first
            while ev is not None:
                if isinstance(ev, Finish):
                    yield _data(fmt.chunk(None, ev))
                    if include_usage:
                        yield _data(fmt.usage_chunk(ev))
                    outcome = "ok"
                    break
                yield _data(fmt.chunk(ev))
                ev = await anext(events, None)
        except GenerationFailed as exc:
            outcome = "failed"
            yield _data(error_body(exc.message, exc.status))
        finally:
            await events.aclose()
            router.metrics.in_flight.dec()
            router.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        yield "data: [DONE]\n\n"

    return SSEResponse(sse(), media_type="text/event-stream")


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
