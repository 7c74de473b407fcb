"""The attempt loop: one client request, as many prefill/decode attempts as it takes.

The request is in token ids from the start (``GenerationRequest.prompt_ids``). Attempt *k*
sends ``prompt_ids + delivered`` (every token id already given to the client) to a prefill
engine with ``max_tokens: 1`` and ``do_remote_decode``, then the same ids with P's
``kv_transfer_params`` to a decode engine, which streams the continuation. When D fails the
request (an error event, e.g. a KV load failure under vLLM's default
``kv_load_failure_policy: fail``), finishes it with ``stop_reason: "recomputed"``
(vllm-ascend's recompute scheduler gives a request back that way), aborts it, or the stream
breaks, the next attempt continues from the last delivered token. With greedy sampling the
client's tokens are then those one engine would have produced in one go.

Nothing here knows about HTTP frameworks: the front turns the events into OpenAI responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvcompose.proxy.backends import Backend, BackendPool
from kvcompose.proxy.config import ProxyConfig
from kvcompose.proxy.metrics import ProxyMetrics
from kvcompose.proxy.stops import StopStrings
from kvcompose.proxy.transport import BackendError, Tokenized, Transport

log = logging.getLogger("kvcompose.proxy")


def request_log(request_id: str, attempt: int) -> logging.LoggerAdapter[logging.Logger]:
    """The proxy's log for one attempt of one request: every line starts with
    ``req=<id> attempt=<k>`` (``attempt=0``: before the first attempt, while tokenizing), so
    the lines of concurrent requests can be told apart and grepped."""
    return _RequestLog(log, {"req": request_id, "attempt": attempt})


class _RequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        return f"req={extra['req']} attempt={extra['attempt']} {msg}", kwargs


#: D's finish reasons that mean "not finished, try again" (vLLM: ``v1/engine/__init__.py``
#: FINISH_REASON_STRINGS; "abort" is what an engine reports for a request it dropped).
RETRY_FINISH = {"abort", "error"}
#: vllm-ascend's D: ``finish_reason=STOP, new_token_ids=[], stop_reason="recomputed"``
#: (``vllm_ascend/core/recompute_scheduler.py``, ``update_from_output``).
RECOMPUTED = "recomputed"


@dataclass
class GenerationRequest:
    request_id: str
    model: str
    prompt_ids: list[int]
    max_tokens: int | None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # passed to the backends as is


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Finish:
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    completion_tokens: int
    attempts: int


class GenerationFailed(Exception):
    """The request cannot be served: ``status`` is the HTTP status for the client."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body


class _Retry(Exception):
    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


class Router:
    """The proxy's core: backends, the HTTP transport, the policy, the metrics."""

    def __init__(self, config: ProxyConfig, pool: BackendPool, transport: Transport,
                 metrics: ProxyMetrics) -> None:  # fmt: skip
        self.config = config
        self.pool = pool
        self.transport = transport
        self.metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()

    # ----------------------------------------------------------------- tokenizing

    async def tokenize(self, body: dict[str, Any], request_id: str) -> Tokenized:
        """The prompt's token ids from a backend's ``/tokenize`` (any healthy one)."""
        tried: set[str] = set()
        last = "no healthy backend"
        for _ in range(self.config.max_attempts):
            backend = self.pool.pick("prefill", tried) or self.pool.pick("decode", tried)
            if backend is None or backend.url in tried:
                break
            tried.add(backend.url)
            try:
                with backend.use():
                    return await self.transport.tokenize(backend, body)
            except BackendError as exc:
                if exc.client_error:
                    raise GenerationFailed(exc.status or 400, str(exc), exc.body) from exc
                self.pool.mark_failed(backend, str(exc))
                last = str(exc)
                request_log(request_id, 0).warning("tokenize failed: %s", exc)
        raise GenerationFailed(503, f"cannot tokenize the prompt: {last}")

    # ----------------------------------------------------------------- generation

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta | Finish]:
        """Deltas as the client should see them, then one ``Finish``; or ``GenerationFailed``."""
        delivered: list[int] = []
        stops = StopStrings(req.stop, req.include_stop_str_in_output, req.min_tokens)
        failures: list[str] = []
        avoid: set[str] = set()  # backends that failed this request: tried last
        attempt = 0
        t0 = time.monotonic()
        try:
            while True:
                remaining = None if req.max_tokens is None else req.max_tokens - len(delivered)
                if remaining is not None and remaining <= 0:
                    yield self._finish(req, delivered, "length", None, attempt)
                    return
                if attempt >= self.config.max_attempts:
                    raise GenerationFailed(
                        503,
                        f"request {req.request_id}: gave up after {attempt} attempts "
                        f"({len(delivered)} tokens delivered); last error: {failures[-1]}",
                    )
                attempt += 1
                if failures:
                    await asyncio.sleep(self.config.backoff(len(failures)))
                try:
                    async for item in self._attempt(
                        req, attempt, delivered, stops, remaining, avoid
                    ):
                        yield item
                        if isinstance(item, Finish):
                            return
                except _Retry as retry:
                    failures.append(str(retry))
                    self.metrics.retries.labels(cause=retry.cause).inc()
                    request_log(req.request_id, attempt).warning(
                        "%s: %s (%d tokens delivered)", retry.cause, retry, len(delivered)
                    )
        finally:
            self.metrics.attempts.observe(attempt)
            self.metrics.request_seconds.observe(time.monotonic() - t0)

    @staticmethod
    def _finish(
        req: GenerationRequest,
        delivered: list[int],
        reason: str,
        stop_reason: int | str | None,
        attempts: int,
    ) -> Finish:
        return Finish(reason, stop_reason, len(req.prompt_ids), len(delivered), attempts)

    async def _attempt(
        self, req: GenerationRequest, attempt: int, delivered: list[int], stops: StopStrings,
        remaining: int | None, avoid: set[str],
    ) -> AsyncIterator[Delta | Finish]:  # fmt: skip
        rlog = request_log(req.request_id, attempt)
        rid = f"{req.request_id}-{attempt}"
        prompt = [*req.prompt_ids, *delivered]
        params, prefill = await self._prefill(req, rid, prompt, attempt, avoid)

        decode = self.pool.pick("decode", avoid)
        if decode is None:
            self._release_later(params, req.request_id, attempt)
            raise _Retry("no_decode", "no healthy decode backend")
        body = {
            **req.sampling, "model": req.model, "prompt": prompt, "stream": True,
            "return_token_ids": True, "kv_transfer_params": params,
            "request_id": f"{rid}-d", "min_tokens": max(0, req.min_tokens - len(delivered)),
        }  # fmt: skip
        if remaining is not None:
            body["max_tokens"] = remaining
        if stops.stops:
            body["stop"] = stops.stops
            body["include_stop_str_in_output"] = True
        rlog.debug("decode on %s (%d prompt ids)", decode.url, len(prompt))
        started = False
        got = 0  # tokens this attempt delivered
        t0 = time.monotonic()
        try:
            with decode.use():
                async with contextlib.aclosing(self.transport.decode(decode, body)) as events:
                    async for ev in events:
                        started = True
                        if ev.error is not None:
                            raise _Retry(
                                "decode_error",
                                f"decode {decode.url}: {ev.error.get('message', ev.error)}",
                            )
                        if ev.finish_reason is not None and ev.stop_reason == RECOMPUTED:
                            raise _Retry(
                                "recomputed",
                                f"decode {decode.url} gave the request "
                                "back (stop_reason recomputed)",
                            )
                        if ev.finish_reason in RETRY_FINISH:
                            raise _Retry(
                                f"decode_{ev.finish_reason}",
                                f"decode {decode.url} finished with {ev.finish_reason}",
                            )
                        if remaining is not None:
                            ev.token_ids = ev.token_ids[: remaining - got]
                        got += len(ev.token_ids)
                        delivered.extend(ev.token_ids)
                        d_stop = (
                            ev.stop_reason
                            if ev.finish_reason == "stop" and ev.stop_reason in stops.stops
                            else None
                        )
                        text, match = stops.feed(ev.text, len(ev.token_ids), d_stop)
                        if text or ev.token_ids:
                            yield Delta(text, ev.token_ids)
                        if match is not None:
                            yield self._finish(req, delivered, "stop", match.stop, attempt)
                            return
                        if ev.finish_reason is not None:
                            tail = stops.flush()
                            if tail:
                                yield Delta(tail, [])
                            yield self._finish(
                                req, delivered, ev.finish_reason, ev.stop_reason, attempt
                            )
                            return
            raise _Retry(
                "stream_dropped", f"decode {decode.url}: the stream ended without a finish reason"
            )
        except BackendError as exc:
            if not started:  # D did not take the hand-off: P holds its blocks for nothing
                self._release_later(params, req.request_id, attempt)
            if exc.client_error:
                raise GenerationFailed(exc.status or 400, str(exc), exc.body) from exc
            avoid.add(decode.url)
            if exc.kind != "status" or (exc.status or 0) >= 500:
                self.pool.mark_failed(decode, str(exc))
            if got == 0:
                avoid.add(prefill.url)
            cause = "stream_dropped" if started else "decode_failed"
            raise _Retry(cause, str(exc)) from exc
        except _Retry:
            avoid.add(decode.url)
            if got == 0:
                # D failed before its first token: most often the hand-off itself (P died,
                # its blocks are gone, its lease ran out), so P is suspect as well. D may
                # never have read P's blocks (a NIXL handshake that timed out): release the
                # hand-off rather than leave them to P's lease (if D did read them, P only
                # logs the second notification).
                avoid.add(prefill.url)
                self._release_later(params, req.request_id, attempt)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away. D aborts a request whose connection closed, and its
            # NIXL then frees P's blocks; a request that never reached D's engine cannot,
            # so a hand-off D has not answered yet is released (a second notification
            # for blocks already freed only makes P log an error line).
            if not started:
                self._release_later(params, req.request_id, attempt)
            raise
        finally:
            self.metrics.backend_seconds.labels(role="decode").observe(time.monotonic() - t0)

    async def _prefill(
        self, req: GenerationRequest, rid: str, prompt: list[int], attempt: int, avoid: set[str]
    ) -> tuple[dict[str, Any], Backend]:
        backend = self.pool.pick("prefill", avoid)
        if backend is None:
            raise _Retry("no_prefill", "no healthy prefill backend")
        body = {
            **{k: v for k, v in req.sampling.items() if k not in ("stop_token_ids",)},
            "model": req.model, "prompt": prompt, "max_tokens": 1, "min_tokens": 0,
            "stream": False, "request_id": f"{rid}-p",
            "kv_transfer_params": {"do_remote_decode": True},
        }  # fmt: skip
        t0 = time.monotonic()
        # The prefill runs as a task of its own, so that the client leaving can be answered
        # by what P has done so far (below).
        answering = asyncio.Event()
        task = asyncio.ensure_future(self._call_prefill(backend, body, answering))
        try:
            params = await asyncio.shield(task)
        except asyncio.CancelledError:
            # The client left. Before P answers, closing P's connection makes vLLM abort the
            # prefill (``with_cancellation`` on its completion route), and NIXL frees an
            # aborted prefill's blocks at once (``request_finished``). Once P answers, the
            # prefill is over and its blocks wait for a D: let the answer arrive, release it.
            if answering.is_set():
                task.add_done_callback(lambda t: self._release_done(t, req.request_id, attempt))
            else:
                task.cancel()
            raise
        except BackendError as exc:
            if exc.client_error:
                raise GenerationFailed(exc.status or 400, str(exc), exc.body) from exc
            avoid.add(backend.url)
            self.pool.mark_failed(backend, str(exc))
            raise _Retry("prefill_failed", str(exc)) from exc
        finally:
            self.metrics.backend_seconds.labels(role="prefill").observe(time.monotonic() - t0)
        request_log(req.request_id, attempt).debug("prefilled on %s", backend.url)
        return params, backend

    async def _call_prefill(
        self, backend: Backend, body: dict[str, Any], answering: asyncio.Event
    ) -> dict[str, Any]:
        with backend.use():
            return await self.transport.prefill(backend, body, answering)

    # ----------------------------------------------------------------- releasing

    def _release_done(self, task: asyncio.Future[dict[str, Any]], request_id: str,
                      attempt: int) -> None:  # fmt: skip
        if not task.cancelled() and task.exception() is None:
            self._release_later(task.result(), request_id, attempt)

    def _release_later(self, params: dict[str, Any], request_id: str, attempt: int) -> None:
        if not self.config.release_stale_handoffs:
            return
        task = asyncio.ensure_future(self.release(params, request_id, attempt))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, params: dict[str, Any], request_id: str, attempt: int) -> bool:
        """Have a healthy decode engine reject the hand-off, so P frees its blocks now."""
        rlog = request_log(request_id, attempt)
        backend = self.pool.pick("decode")
        if backend is None:
            rlog.warning(
                "no decode backend to release the hand-off; P keeps the blocks until its "
                "kv_lease_duration"
            )
            self.metrics.releases.labels(outcome="no_backend").inc()
            return False
        try:
            status = await self.transport.release(
                backend, params, f"{request_id}-{attempt}-release"
            )
        except BackendError as exc:
            rlog.warning("releasing the hand-off failed: %s", exc)
            self.metrics.releases.labels(outcome="failed").inc()
            return False
        rlog.info("hand-off released through %s (HTTP %d)", backend.url, status)
        self.metrics.releases.labels(outcome="sent").inc()
        return True

    async def drain(self) -> None:
        """Wait for pending releases (at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
