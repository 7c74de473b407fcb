"""Two real engines in prefill/decode roles, each in its own process.

``EngineProcess`` runs a single-process ``vllm.LLM`` in a child process (``spawn``) and serves
``generate``/``stats``/``close`` over a pipe. While idle, the child keeps stepping its engine
as long as the scheduler holds requests (as ``EngineCore``'s busy loop would), so a prefill
engine notices that the decode side has pulled its blocks and frees them.

``PDPair`` starts a prefill (P) and a decode (D) engine with a P/D connector (by default vLLM's
NixlConnector over UCX with ``kv_buffer_device: "cpu"``) and distinct NIXL side-channel ports.
``PDPair.generate`` runs the usual proxy flow: P with ``max_tokens=1`` and
``{"do_remote_decode": True}``, then D with the ``kv_transfer_params`` P returned.
The connector config is a parameter, so kvcompose trees containing NIXL can be used too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

#: The default P/D connector: NIXL over UCX between host-memory KV buffers.
NIXL_CPU_CONFIG: dict[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"backends": ["UCX"]},
}

#: Keep the pair small: each engine holds its KV cache in host memory.
PD_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineError(RuntimeError):
    """The engine process failed; the message holds its traceback."""


class EngineProcess:
    """A ``vllm.LLM`` in its own process.

    ``kv_transfer_config``: the dict form of ``KVTransferConfig`` (``kv_role`` defaults to
    ``"kv_both"``). ``env``: extra environment for the child, applied before vLLM is
    imported there (e.g. ``VLLM_NIXL_SIDE_CHANNEL_PORT``). ``llm_kwargs`` go to ``vllm.LLM``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None = None,
        *,
        name: str = "engine",
        env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        start_timeout: float = 300.0,
        call_timeout: float = 300.0,
    ) -> None:
        self.name = name
        self.call_timeout = call_timeout
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(
                child_conn,
                str(model_dir),
                kv_transfer_config,
                dict(env or {}),
                dict(llm_kwargs or {}),
            ),
            name=f"kvcompose-{name}",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._closed = False
        try:
            self.info: dict[str, Any] = self._receive(start_timeout, what="start-up")
        except BaseException:
            self._kill()
            raise

    # ------------------------------------------------------------------ calls

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | list[dict[str, Any] | None] | None = None,
    ) -> list[tuple[list[int], dict[str, Any] | None]]:
        """Greedy generation; one ``(token_ids, kv_transfer_params)`` per prompt, where the
        params are what the engine returned for the request (P/D hand-off)."""
        return self._call("generate", [list(p) for p in prompts], max_tokens, kv_transfer_params)

    def stats(self) -> dict[str, Any]:
        """Prometheus metrics of the engine (``vllm:*``): counters and gauges as numbers
        (summed over labels), histograms as ``{"count": n, "sum": s}``. NIXL's
        ``vllm:nixl_bytes_transferred`` etc. appear once transfers happened."""
        return self._call("stats")

    def is_idle(self) -> bool:
        """True when the engine's scheduler holds no request (finished or not)."""
        return self._call("idle")

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until the scheduler holds no request (e.g. P after D pulled its blocks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_idle():
                return True
            time.sleep(0.2)
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Shut the engine down and end the process (killed after ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._conn.send(("close",))
                if self._conn.poll(timeout):
                    with contextlib.suppress(EOFError, OSError):
                        self._conn.recv()
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(timeout=10)
        self._kill()
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _call(self, *msg: Any) -> Any:
        if self._closed:
            raise EngineError(f"{self.name}: closed")
        self._conn.send(msg)
        return self._receive(self.call_timeout, what=str(msg[0]))

    def _receive(self, timeout: float, *, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineError(
                    f"{self.name}: process died during {what} (exit code {self._proc.exitcode})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no answer to {what} within {timeout:.0f} s")
        kind, payload = self._conn.recv()
        if kind == "error":
            raise EngineError(f"{self.name}: {what} failed in the engine process:\n{payload}")
        return payload

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


class PDPair:
    """A prefill engine and a decode engine joined by a P/D connector (NIXL by default).

    ``kv_transfer_config`` (or separate ``prefill_config``/``decode_config``) is the dict form
    of ``KVTransferConfig``; each engine gets its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None = None,
        *,
        prefill_config: dict[str, Any] | None = None,
        decode_config: dict[str, Any] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        base = kv_transfer_config if kv_transfer_config is not None else NIXL_CPU_CONFIG
        p_cfg = prefill_config if prefill_config is not None else base
        d_cfg = decode_config if decode_config is not None else base
        p_port, d_port = free_port(), free_port()
        while d_port == p_port:
            d_port = free_port()
        common = {**PD_ENGINE_ENV, **(env or {})}
        self.prefill: EngineProcess | None = None
        self.decode: EngineProcess | None = None
        try:
            self.prefill = EngineProcess(
                model_dir, p_cfg, name="prefill", llm_kwargs=llm_kwargs,
                env={**common, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_port)},
                start_timeout=start_timeout,
            )  # fmt: skip
            self.decode = EngineProcess(
                model_dir, d_cfg, name="decode", llm_kwargs=llm_kwargs,
                env={**common, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port)},
                start_timeout=start_timeout,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise

    def generate(
        self, prompts: list[list[int]], max_tokens: int
    ) -> tuple[list[list[int]], list[dict[str, Any] | None]]:
        """Prefill on P (1 token, ``do_remote_decode``), decode on D with P's params.

        Returns D's token ids per prompt and the params P handed over.
        """
        assert self.prefill is not None and self.decode is not None
        p_out = self.prefill.generate(prompts, 1, {"do_remote_decode": True})
        handoff = [params for _, params in p_out]
        d_out = self.decode.generate(prompts, max_tokens, handoff)
        return [tokens for tokens, _ in d_out], handoff

    def close(self) -> None:
        for eng in (self.decode, self.prefill):
            if eng is not None:
                eng.close()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- child side


def _engine_main(
    conn: Any,
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    env: dict[str, str],
    llm_kwargs: dict[str, Any],
) -> None:
    os.environ.update(env)
    try:
        from kvcompose.testing.engine import engine_env

        engine_env()  # before vLLM/torch are imported in this process
        from kvcompose.testing.engine import cleanup, greedy, make_llm

        llm_kwargs.setdefault("disable_log_stats", False)
        with make_llm(model_dir, kv_transfer_config, **llm_kwargs) as llm:
            core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
            conn.send(("ok", {"pid": os.getpid(), "env": env}))
            _serve(conn, llm, core, greedy)
        cleanup()
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _serve(conn: Any, llm: Any, core: Any, greedy: Callable[..., Any]) -> None:
    while True:
        if not conn.poll(0.05):
            # Idle: keep the engine stepping while its scheduler holds requests (finished
            # ones waiting for a transfer to complete, e.g. P's blocks until D has read them).
            if core.scheduler.has_requests():
                llm.llm_engine.step()
            continue
        msg = conn.recv()
        op = msg[0]
        try:
            if op == "close":
                conn.send(("ok", None))
                return
            if op == "generate":
                _, prompts, max_tokens, params = msg
                outs = greedy(llm, prompts, max_tokens, kv_transfer_params=params,
                              return_outputs=True)  # fmt: skip
                result = [(list(o.outputs[0].token_ids), o.kv_transfer_params) for o in outs]
                conn.send(("ok", result))
            elif op == "stats":
                conn.send(("ok", _metrics(llm)))
            elif op == "idle":
                conn.send(("ok", not core.scheduler.has_requests()))
            else:
                conn.send(("error", f"unknown op {op!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _metrics(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter | Gauge):
            out[m.name] = out.get(m.name, 0) + m.value
        elif isinstance(m, Histogram):
            prev = out.get(m.name, {"count": 0, "sum": 0.0})
            out[m.name] = {"count": prev["count"] + m.count, "sum": prev["sum"] + m.sum}
        elif isinstance(m, Vector):
            out[m.name] = list(m.values)
    return out
