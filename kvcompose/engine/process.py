"""A real engine in a child process: ``EngineProcess``.

The child (``spawn``) builds a single-process ``vllm.LLM`` with ``make_llm`` and serves
``generate``/``stats``/``call``/``close`` over a pipe. A child of its own per engine gives
every engine a clean process (vLLM's global state, the KV-transfer group, OpenMP threads) and
lets several engines run side by side (prefill/decode pairs) or one after another (the bench).

While idle, the child keeps stepping its engine as long as the scheduler holds requests (as
``EngineCore``'s busy loop would), so a prefill engine notices that the decode side has pulled
its blocks and frees them.

``preloaded=True`` forks the child from a ``forkserver`` that has imported vLLM once
(``kvcompose.engine.preload``) instead of spawning a fresh interpreter that imports it again:
about 10 s less per engine start on 2 cores, for runs that start many engines one after
another.

``call(fn, ...)`` runs any module-level function on the child's ``LLM``; such a function may
send progress with ``report_progress(**fields)``, which reaches the parent's ``on_progress``
while the call runs.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: how long the idle child waits for a message while its scheduler holds requests, between
#: two engine steps (EngineCore's busy loop does not wait at all)
IDLE_STEP_S = 0.005
#: how long it waits while the scheduler holds nothing
IDLE_POLL_S = 0.05


class EngineError(RuntimeError):
    """The engine process failed; the message holds its traceback, ``summary`` the exception
    (``Type: message``) where one was raised."""

    def __init__(self, message: str, summary: str | None = None) -> None:
        super().__init__(message)
        self.summary = summary or message.strip().splitlines()[-1]


class EngineProcess:
    """A ``vllm.LLM`` in its own process.

    ``kv_transfer_config``: the dict form of ``KVTransferConfig`` (``kv_role`` defaults to
    ``"kv_both"``). ``env``: environment for the child, applied before vLLM is imported there
    (e.g. ``VLLM_NIXL_SIDE_CHANNEL_PORT``; a NIXL poll pause it sets is installed there too).
    ``llm_kwargs`` go to ``vllm.LLM`` (vLLM's stats logging is on unless they say otherwise,
    so that ``stats`` has numbers). ``log_file``: the child's stdout and stderr go there
    instead of the parent's. ``on_progress`` receives what
    functions run by ``call`` report. ``preloaded``: fork from the server that has vLLM
    imported (see the module's docstring) instead of spawning. ``wait=False`` returns as soon
    as the child is started; ``wait_started`` (or the first call) then waits for its engine,
    so that several engines start side by side (a spawned one spends most of its start
    importing vLLM on one core).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        kv_transfer_config: dict[str, Any] | None = None,
        *,
        name: str = "engine",
        env: dict[str, str] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        log_file: str | os.PathLike[str] | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        start_timeout: float = 300.0,
        call_timeout: float = 300.0,
        preloaded: bool = False,
        wait: bool = True,
    ) -> None:
        self.name = name
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.on_progress = on_progress
        ctx = _preloaded_context() if preloaded else mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(
                child_conn,
                str(model_dir),
                kv_transfer_config,
                dict(env or {}),
                dict(llm_kwargs or {}),
                None if log_file is None else str(log_file),
            ),
            name=f"kvcompose-{name}",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._closed = False
        #: what the child reported once its engine was built (pid, environment)
        self.info: dict[str, Any] | None = None
        if wait:
            self.wait_started()

    def wait_started(self) -> dict[str, Any]:
        """Wait until the child's engine is built (``start_timeout``); the child is killed if
        it fails or does not report in time."""
        if self.info is None:
            try:
                self.info = self._receive(self.start_timeout, what="start-up")
            except BaseException:
                self._kill()
                raise
        return self.info

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

    def call(self, fn: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(llm, *args, **kwargs)`` inside the engine process and return its result.

        ``fn`` is a module-level function or its ``"package.module:name"``; it gets the
        process's ``vllm.LLM`` and runs between engine steps (the idle stepping pauses while
        it runs). Arguments and result travel by pickle."""
        return self._call("call", fn, args, kwargs)

    def close(self, timeout: float = 60.0, *, graceful: bool = True) -> None:
        """Shut the engine down and end the process (killed after ``timeout``).
        ``graceful=False`` ends the process at once (SIGTERM), without the engine's shutdown
        (seconds saved when nothing of the process is needed any more)."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            try:
                if self._proc.is_alive():
                    self._conn.send(("close",))
                    if self._conn.poll(timeout):
                        with contextlib.suppress(EOFError, OSError):
                            self._conn.recv()
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)  # the child tears its engine down and exits
        # Not graceful: no join before the kill, the child would serve on until the timeout.
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
        self.wait_started()
        self._conn.send(msg)
        return self._receive(self.call_timeout, what=str(msg[0]))

    def _receive(self, timeout: float, *, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            while not self._conn.poll(0.2):
                if not self._proc.is_alive():
                    raise EngineError(
                        f"{self.name}: process died during {what} (exit code {self._proc.exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no answer to {what} within {timeout:.0f} s")
            kind, payload = self._conn.recv()
            if kind == "progress":
                if self.on_progress is not None:
                    self.on_progress(payload)
                continue
            if kind == "error":
                summary, tb = payload
                raise EngineError(
                    f"{self.name}: {what} failed in the engine process:\n{tb}", summary
                )
            return payload

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


def _preloaded_context() -> Any:
    """The ``forkserver`` context whose server imports ``kvcompose.engine.preload`` (once per
    parent process; a server already running keeps what it preloaded)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvcompose.engine.preload"])
    return ctx


def preload_server_pid() -> int | None:
    """The pid of this process's ``forkserver`` (``preloaded=True`` children fork from it),
    ``None`` while none runs. It keeps the environment it started in: a caller whose
    children need something at interpreter start-up checks that it started it."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)  # CPython's one server


# ----------------------------------------------------------------------------- child side

#: The pipe to the parent while a ``call`` runs (child process only).
_CALLER: list[Any] = []


def report_progress(**fields: Any) -> None:
    """From a function run by ``EngineProcess.call``: send ``fields`` to the parent's
    ``on_progress`` (nothing happens outside such a call)."""
    if _CALLER:
        _CALLER[0].send(("progress", fields))


def _redirect_output(log_file: str) -> None:
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)


def _engine_main(
    conn: Any,
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    env: dict[str, str],
    llm_kwargs: dict[str, Any],
    log_file: str | None,
) -> None:
    if log_file is not None:
        _redirect_output(log_file)
    try:
        _apply_env(env)
        _vllm_log_level()
        _thread_lock_for_progress_bars()
        from kvcompose.engine.llm import cleanup, make_llm

        llm_kwargs.setdefault("disable_log_stats", False)
        with make_llm(model_dir, kv_transfer_config, **llm_kwargs) as llm:
            conn.send(("ok", {"pid": os.getpid(), "env": env}))
            _serve(conn, llm)
        cleanup()
    except BaseException as exc:
        traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", _error(exc)))
        raise
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def _apply_env(env: dict[str, str]) -> None:
    """Give this (child) process ``env`` and the engine environment, before vLLM or torch is
    imported here. The process started with its parent's environment, so what ``env`` asks
    at start-up must be done here: NIXL's poll pause (``KVCOMPOSE_NIXL_POLL_US``), whose
    ``sitecustomize`` either was not on the ``PYTHONPATH`` the process started with or was
    hidden by another one first; with a single-process engine vLLM makes the NIXL agent in
    this very process (``NixlBaseConnectorWorker.__init__``)."""
    os.environ.update(env)
    from kvcompose.engine import nixl_poll
    from kvcompose.engine.llm import engine_env

    engine_env()
    nixl_poll.install_from_env()


def _thread_lock_for_progress_bars() -> None:
    """tqdm makes a multiprocessing lock (a named semaphore) for the first progress bar (the
    engine's weight loading); a child ended by SIGTERM (``close(graceful=False)``) cannot
    unlink it, and the parent's resource tracker then warns of leaked semaphores at exit.
    Only this process writes its bars: a thread lock is enough."""
    with contextlib.suppress(ImportError):
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())


def _vllm_log_level() -> None:
    """In a child forked from the preloaded server, vLLM's logger was configured by the
    server's import: set it to this engine's ``VLLM_LOGGING_LEVEL``."""
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    if not level or "vllm.logger" not in sys.modules:
        return
    import logging

    logger = logging.getLogger("vllm")
    with contextlib.suppress(ValueError, TypeError):
        logger.setLevel(level.upper())
        for handler in logger.handlers:
            handler.setLevel(level.upper())


def _serve(conn: Any, llm: Any) -> None:
    from kvcompose.engine.llm import greedy
    from kvcompose.engine.probe import scheduler

    sched = scheduler(llm)
    while True:
        # Idle: keep the engine stepping while its scheduler holds requests (finished ones
        # waiting for a transfer to complete, e.g. P's blocks until D has read them), a few
        # ms apart, so that P frees what D has read within a step or two, as it would under
        # EngineCore's busy loop, and not only after D has decoded a few dozen tokens.
        holding = sched.has_requests()
        if not conn.poll(IDLE_STEP_S if holding else IDLE_POLL_S):
            if holding:
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
                outs = greedy(
                    llm, prompts, max_tokens, kv_transfer_params=params, return_outputs=True
                )
                result = [(list(o.outputs[0].token_ids), o.kv_transfer_params) for o in outs]
                conn.send(("ok", result))
            elif op == "stats":
                conn.send(("ok", _metrics(llm)))
            elif op == "idle":
                conn.send(("ok", not sched.has_requests()))
            elif op == "call":
                _, fn, args, kwargs = msg
                _CALLER.append(conn)
                try:
                    result = _resolve(fn)(llm, *args, **kwargs)
                finally:
                    _CALLER.clear()
                conn.send(("ok", result))
            else:
                conn.send(("error", (f"unknown op {op!r}", "")))
        except Exception as exc:
            traceback.print_exc()
            conn.send(("error", _error(exc)))


def _error(exc: BaseException) -> tuple[str, str]:
    return f"{type(exc).__name__}: {exc}", traceback.format_exc()


def _resolve(fn: str | Callable[..., Any]) -> Callable[..., Any]:
    from kvcompose.tree.conditions import import_named

    return fn if callable(fn) else import_named(fn)


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
