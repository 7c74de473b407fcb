"""Two real engines in prefill/decode roles, each in its own process.

``EngineProcess`` is ``kvcompose.engine.process.EngineProcess`` (a ``vllm.LLM`` in a child
process) with ``inspect``/``wait_until``, which read the engine-side helpers below.

``PDPair`` starts a prefill (P) and a decode (D) engine with a P/D connector (by default vLLM's
NixlConnector over UCX with ``kv_buffer_device: "cpu"``) and distinct NIXL side-channel ports.
``PDPair.generate`` runs the usual proxy flow: P with ``max_tokens=1`` and
``{"do_remote_decode": True}``, then D with the ``kv_transfer_params`` P returned.
The connector config is a parameter, so kvcompose trees containing NIXL can be used too.

The engine side (functions run inside an engine process through ``EngineProcess.call``)
reads what an engine holds (``snapshot``, ``is_clean``), records scheduler steps, block frees
and every connector's lookups, allocations and finishes (``trace_on``/``take_trace``),
injects faults (``drop_calls``) and runs or aborts requests step by step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from kvcompose.engine import nixl_poll, probe
from kvcompose.engine import process as engine_process
from kvcompose.engine.probe import walk_connectors
from kvcompose.engine.process import EngineError as EngineError
from kvcompose.testing.ports import free_port

#: The default P/D connector: NIXL over UCX between host-memory KV buffers.
NIXL_CPU_CONFIG: dict[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"backends": ["UCX"]},
}

#: Keep the pair small: each engine holds its KV cache in host memory.
PD_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def engine_env(**extra: str) -> dict[str, str]:
    """A P/D engine's environment: ``PD_ENGINE_ENV``, NIXL's progress thread pausing between
    polls (:mod:`kvcompose.engine.nixl_poll`; its spinning took the cores from the engines),
    and ``extra``."""
    return {**PD_ENGINE_ENV, **nixl_poll.environment(), **extra}


class EngineProcess(engine_process.EngineProcess):
    """``kvcompose.engine.process.EngineProcess`` with the P/D tests' inspection calls."""

    def inspect(self) -> dict[str, Any]:
        """``snapshot`` of the engine: block pool usage, requests held by the scheduler,
        kvcompose's and NIXL's per-request tables still holding something."""
        return self.call(snapshot)

    def wait_until(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 60.0,
        interval: float = 0.05,
    ) -> dict[str, Any] | None:
        """Poll ``inspect()`` until ``predicate(snapshot)`` holds; the first snapshot that
        satisfies it, or ``None`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.inspect()
            if predicate(snap):
                return snap
            if time.monotonic() > deadline:
                return None
            time.sleep(interval)


class PDPair:
    """A prefill engine and a decode engine joined by a P/D connector (NIXL by default).

    ``kv_transfer_config`` (or separate ``prefill_config``/``decode_config``) is the dict form
    of ``KVTransferConfig``; each engine gets its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``. The
    engines fork from the server that has imported vLLM once (``preloaded``, see
    ``kvcompose.engine.process``) unless ``preloaded=False``.
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
        preloaded: bool = True,
    ) -> None:
        base = kv_transfer_config if kv_transfer_config is not None else NIXL_CPU_CONFIG
        p_cfg = prefill_config if prefill_config is not None else base
        d_cfg = decode_config if decode_config is not None else base
        p_port, d_port = free_port(), free_port()
        common = engine_env(**(env or {}))
        self.prefill: EngineProcess | None = None
        self.decode: EngineProcess | None = None
        try:
            self.prefill = EngineProcess(
                model_dir, p_cfg, name="prefill", llm_kwargs=llm_kwargs,
                env={**common, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_port)},
                start_timeout=start_timeout, preloaded=preloaded, wait=False,
            )  # fmt: skip
            self.decode = EngineProcess(
                model_dir, d_cfg, name="decode", llm_kwargs=llm_kwargs,
                env={**common, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port)},
                start_timeout=start_timeout, preloaded=preloaded, wait=False,
            )  # fmt: skip
            self.prefill.wait_started()  # the two start side by side
            self.decode.wait_started()
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


# ----------------------------------------------------------------------------- engine side
# Functions run inside an engine process through ``EngineProcess.call`` (their first argument
# is that process's ``vllm.LLM``). They read state, or wrap methods to record what happened
# without changing what the methods do. Times are ``time.monotonic()``, which is one clock for
# every process of the machine, so events of the P and D engines can be compared.


def scheduler_connectors(llm: Any) -> dict[str, Any]:
    """The scheduler-side connector tree, by path (``"root"``, ``"nixl"``, ``"a/b"``)."""
    return {n.path: n.connector for n in walk_connectors(probe.scheduler_connector(llm))}


_TRACE: dict[str, Any] = {}


def trace_on(llm: Any) -> None:
    """Record, with ``time.monotonic()`` stamps: every scheduler step, and the tokens each
    step scheduled per request (``scheduled``: what the engine computed, so a load that
    failed shows as recomputed tokens); every block free of a request (``free``: request id,
    blocks); and for every connector of the scheduler-side tree, each ``lookup`` (what it
    answered), ``alloc`` (the tokens it was told) and ``finished`` (whether it delays the
    free). Idempotent; ``take_trace`` reads it."""
    if "trace" in _TRACE:
        return
    trace: dict[str, Any] = {"steps": 0, "step_times": [], "events": [], "scheduled": {}}
    _TRACE["trace"] = trace
    sched = probe.scheduler(llm)
    events = trace["events"]

    orig_schedule = sched.schedule

    def schedule(*a: Any, **kw: Any) -> Any:
        trace["steps"] += 1
        times = trace["step_times"]
        times.append(time.monotonic())
        if len(times) > 20000:
            del times[:10000]
        out = orig_schedule(*a, **kw)
        scheduled = trace["scheduled"]
        for req_id, n in out.num_scheduled_tokens.items():
            scheduled[req_id] = scheduled.get(req_id, 0) + n
        return out

    sched.schedule = schedule

    orig_free = sched._free_blocks

    def free_blocks(request: Any) -> Any:
        try:
            n = sum(len(g) for g in sched.kv_cache_manager.get_block_ids(request.request_id))
        except Exception:
            n = None
        events.append(
            {
                "kind": "free",
                "t": time.monotonic(),
                "req": request.request_id,
                "blocks": n,
                "step": trace["steps"],
            }
        )
        return orig_free(request)

    sched._free_blocks = free_blocks

    for path, conn in scheduler_connectors(llm).items():
        _wrap_connector(conn, path, trace)
        _rebind(llm, conn)


def _rebind(llm: Any, conn: Any) -> None:
    """Let kvcompose nodes above ``conn`` re-cache its (now wrapped) hot-path methods
    (vLLM's ``MultiConnector`` looks them up on every call and caches none)."""
    for _, parent in scheduler_connectors(llm).items():
        refresh = getattr(parent, "refresh_child_methods", None)
        if refresh is not None and conn in (getattr(parent, "_connectors", None) or ()):
            refresh()


def _wrap_connector(conn: Any, path: str, trace: dict[str, Any]) -> None:
    events = trace["events"]
    lookup, alloc, finish = (
        conn.get_num_new_matched_tokens,
        conn.update_state_after_alloc,
        conn.request_finished,
    )

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
        result = lookup(request, num_computed_tokens)
        events.append(
            {
                "kind": "lookup",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "local": num_computed_tokens,
                "result": tuple(result),
                "step": trace["steps"],
            }
        )
        return result

    def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        events.append(
            {
                "kind": "alloc",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "tokens": num_external_tokens,
                "step": trace["steps"],
            }
        )
        return alloc(request, blocks, num_external_tokens)

    def finished(request: Any, result: Any) -> Any:
        events.append(
            {
                "kind": "finished",
                "t": time.monotonic(),
                "node": path,
                "req": request.request_id,
                "delay": bool(result[0]),
                "status": request.status.name,
                "step": trace["steps"],
            }
        )
        return result

    conn.get_num_new_matched_tokens = get_num_new_matched_tokens
    conn.update_state_after_alloc = update_state_after_alloc
    conn.request_finished = lambda request, block_ids: finished(request, finish(request, block_ids))
    # A parent that supports the hybrid KV cache manager (MultiConnector, vLLM's scheduler
    # itself) finishes such a child through this method instead. Where it calls the child's
    # own request_finished, the finish is recorded twice, which no reader counts.
    finish_all = getattr(conn, "request_finished_all_groups", None)
    if finish_all is not None:
        conn.request_finished_all_groups = lambda request, block_ids: finished(
            request, finish_all(request, block_ids)
        )


def take_trace(llm: Any, clear: bool = True) -> dict[str, Any]:
    """The recorded events, step times and scheduled tokens per request since ``trace_on``
    or the last ``take_trace``."""
    trace = _TRACE.get("trace")
    if trace is None:
        return {"steps": None, "step_times": [], "events": [], "scheduled": {}}
    out = {
        "steps": trace["steps"],
        "step_times": list(trace["step_times"]),
        "events": list(trace["events"]),
        "scheduled": dict(trace["scheduled"]),
    }
    if clear:
        trace["events"].clear()
        trace["step_times"].clear()
        trace["scheduled"].clear()
    return out


_DROPPED: dict[tuple[str, str], Any] = {}


def drop_calls(
    llm: Any, node: str, method: str, *, zero_only: bool = False, enable: bool = True
) -> None:
    """Fault injection: the scheduler-side connector at ``node`` (a path of
    ``scheduler_connectors``) stops receiving ``method`` calls, as if its parent stopped
    talking to it. ``zero_only`` (for ``update_state_after_alloc``) drops only the calls
    with 0 external tokens: the upstream bug where a composite does not tell a child that
    another child owns the load. Dropped calls are recorded as ``dropped`` trace events.
    ``enable=False`` restores the method."""
    conn = scheduler_connectors(llm)[node]
    key = (node, method)
    if not enable:
        if key in _DROPPED:
            setattr(conn, method, _DROPPED.pop(key))
            _rebind(llm, conn)
        return
    if key in _DROPPED:
        return
    original = getattr(conn, method)
    _DROPPED[key] = original
    trace = _TRACE.get("trace")

    def dropped(*args: Any, **kwargs: Any) -> Any:
        if zero_only and not (len(args) >= 3 and args[2] == 0):
            return original(*args, **kwargs)
        if trace is not None:
            request = args[0] if args else None
            trace["events"].append(
                {
                    "kind": "dropped",
                    "t": time.monotonic(),
                    "node": node,
                    "method": method,
                    "req": getattr(request, "request_id", None),
                    "step": trace["steps"],
                }
            )
        if method in ("request_finished", "request_finished_all_groups"):
            return False, None
        return None

    setattr(conn, method, dropped)
    _rebind(llm, conn)


def worker_connectors(llm: Any) -> dict[str, Any]:
    """The worker-side connector tree of a single-process engine, by path."""
    try:
        root = probe.worker_connector()
    except Exception:
        return {}
    return {n.path: n.connector for n in walk_connectors(root)}


def store_totals(llm: Any) -> dict[str, dict[str, Any]]:
    """Cumulative worker-side counters (``tokens_loaded``, ``bytes_loaded``, ...) of every
    connector in the tree that keeps them (kvcompose's stores), by path."""
    out: dict[str, dict[str, Any]] = {}
    for path, conn in worker_connectors(llm).items():
        totals = getattr(conn, "total_stats", None)
        data = getattr(totals, "data", None)
        if isinstance(data, dict):
            out[path] = dict(data)
    return out


def connector_paths(llm: Any, side: str = "scheduler") -> dict[str, str]:
    """Path → class name of every connector in the tree (``side``: scheduler or worker)."""
    tree = scheduler_connectors(llm) if side == "scheduler" else worker_connectors(llm)
    return {path: type(conn).__name__ for path, conn in tree.items()}


#: Per-request tables of NIXL's scheduler and worker halves that must be empty once nothing
#: is in flight (P: blocks waiting for D's read; D: reads and notifications not done).
NIXL_SCHEDULER_TABLES = (
    "_reqs_need_recv",
    "_reqs_need_save",
    "_reqs_need_send",
    "_reqs_in_batch",
    "_reqs_not_processed",
    "_heartbeat_req_engine",
)
NIXL_WORKER_TABLES = (
    "_recving_metadata",
    "_recving_transfers",
    "_reqs_to_send",
    "_reqs_to_process",
    "consumer_notification_counts_by_req",
)


def _tables(obj: Any, names: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        table = getattr(obj, name, None)
        if table:
            out[name] = sorted(str(k) for k in table)
    ready = getattr(obj, "_ready_requests", None)
    if ready is not None and ready.qsize():
        out["_ready_requests"] = ready.qsize()
    return out


def nixl_live(llm: Any) -> dict[str, Any]:
    """NIXL's per-request tables that still hold something, per NIXL connector in the tree
    (``{}`` when nothing is in flight). ``_reqs_to_send`` on P: requests whose blocks wait
    for D's read (with their lease)."""
    out: dict[str, Any] = {}
    for side, tree in (
        ("scheduler", scheduler_connectors(llm)),
        ("worker", worker_connectors(llm)),
    ):
        for path, conn in tree.items():
            # NixlConnector (vLLM builds NixlPullConnector/NixlPushConnector) by shape
            if not (hasattr(conn, "connector_scheduler") and hasattr(conn, "connector_worker")):
                continue
            half = getattr(conn, f"connector_{side}", None)
            names = NIXL_SCHEDULER_TABLES if side == "scheduler" else NIXL_WORKER_TABLES
            live = _tables(half, names) if half is not None else {}
            if live:
                out.setdefault(path, {})[side] = live
    return out


def kvcompose_live(llm: Any) -> dict[str, Any]:
    """``live_requests()`` of the kvcompose root on the scheduler and the worker side
    (``{}`` when nothing is in flight or the root is not a kvcompose node)."""
    out: dict[str, Any] = {}
    for side, tree in (
        ("scheduler", scheduler_connectors(llm)),
        ("worker", worker_connectors(llm)),
    ):
        root = tree.get("root")
        live = getattr(root, "live_requests", None)
        if live is not None:
            tables = live()
            if tables:
                out[side] = tables
    return out


def snapshot(llm: Any) -> dict[str, Any]:
    """What the engine holds now: ``used_blocks`` (of ``total_blocks``, cached-but-free
    blocks count as free), ``requests`` (request id → status, KV blocks held; finished
    requests whose blocks wait for a transfer stay here), queue lengths, the scheduler's
    step count since ``trace_on`` (or None), ``kvcompose`` and ``nixl`` live tables."""
    sched = probe.scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1  # the null block is never free
    free = pool.get_num_free_blocks()
    requests: dict[str, Any] = {}
    for req_id, req in sched.requests.items():
        try:
            blocks = sum(len(g) for g in sched.kv_cache_manager.get_block_ids(req_id))
        except Exception:
            blocks = None
        requests[req_id] = {
            "status": req.status.name,
            "blocks": blocks,
            "computed": req.num_computed_tokens,
        }
    trace = _TRACE.get("trace")
    return {
        "t": time.monotonic(),
        "total_blocks": total,
        "free_blocks": free,
        "used_blocks": total - free,
        "deferred_frees": len(getattr(sched, "deferred_frees", ()) or ()),
        "requests": requests,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "has_requests": sched.has_requests(),
        "steps": None if trace is None else trace["steps"],
        "kvcompose": kvcompose_live(llm),
        "nixl": nixl_live(llm),
    }


def is_clean(snap: dict[str, Any]) -> bool:
    """No request, no used block, no deferred free, empty kvcompose and NIXL tables."""
    return (
        not snap["requests"]
        and snap["used_blocks"] == 0
        and not snap["deferred_frees"]
        and not snap["kvcompose"]
        and not snap["nixl"]
    )


def _sampling(max_tokens: int, params: dict[str, Any] | None) -> Any:
    from kvcompose.engine.llm import sampling_params

    return sampling_params(
        max_tokens, extra_args={"kv_transfer_params": dict(params)} if params else None
    )


def run_requests(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | list[dict[str, Any] | None] | None = None,
    *,
    request_ids: list[str] | None = None,
    timeout: float = 300.0,
) -> list[dict[str, Any]]:
    """Greedy generation like ``EngineProcess.generate``, with more detail per prompt:
    ``request_id`` (the engine's internal id), ``token_ids``, ``kv_transfer_params``,
    ``num_cached_tokens`` (local and external prefix hits)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    if kv_transfer_params is None or isinstance(kv_transfer_params, dict):
        per_prompt = [kv_transfer_params] * len(prompts)
    else:
        per_prompt = list(kv_transfer_params)
    ids = request_ids or [f"run-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    internal: dict[str, str] = {}
    for ext, prompt, params in zip(ids, prompts, per_prompt, strict=True):
        internal[ext] = engine.add_request(
            ext, TokensPrompt(prompt_token_ids=list(prompt)), _sampling(max_tokens, params)
        )
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids):
        if time.monotonic() > deadline:
            engine.abort_request(list(internal.values()), internal=True)
            raise TimeoutError(f"requests not finished within {timeout} s")
        for out in engine.step():
            if out.finished and out.request_id in internal:
                done[out.request_id] = out
    return [
        {
            "request_id": internal[ext],
            "token_ids": list(done[ext].outputs[0].token_ids),
            "kv_transfer_params": done[ext].kv_transfer_params,
            "num_cached_tokens": done[ext].num_cached_tokens,
        }
        for ext in ids
    ]


def submit_and_abort(
    llm: Any,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    *,
    when: str = "queued",
    max_steps: int = 200,
) -> dict[str, Any]:
    """Add one request, step the engine until it reaches ``when``, then abort it.

    ``when``: ``"queued"`` (before any step), ``"loading"`` (parked in
    ``WAITING_FOR_REMOTE_KVS``: its async load is in flight), ``"prefilled"`` (its whole prompt
    computed, still running). Returns ``request_id`` (internal), ``steps`` taken, the
    ``status`` and ``computed`` tokens at the abort."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    sched = probe.scheduler(llm)
    ext = f"abort-{time.monotonic_ns()}"
    req_id = engine.add_request(
        ext, TokensPrompt(prompt_token_ids=list(prompt)), _sampling(max_tokens, kv_transfer_params)
    )

    def reached() -> bool:
        req = sched.requests.get(req_id)
        if req is None or req.is_finished():
            raise RuntimeError(f"request {req_id} finished before reaching {when!r}")
        if when == "queued":
            return True
        if when == "loading":
            return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        if when == "prefilled":
            return req.num_computed_tokens >= req.num_prompt_tokens
        raise ValueError(f"unknown stage {when!r}")

    steps = 0
    while not reached():
        if steps >= max_steps:
            raise RuntimeError(f"request {req_id} did not reach {when!r} in {steps} steps")
        engine.step()
        steps += 1
    req = sched.requests[req_id]
    state = {
        "request_id": req_id,
        "steps": steps,
        "status": req.status.name,
        "computed": req.num_computed_tokens,
        "t": time.monotonic(),
    }
    engine.abort_request([req_id], internal=True)
    return state


def reset_prefix_cache(llm: Any) -> bool:
    """Drop the engine's local prefix cache (not the connectors' stores)."""
    return bool(llm.reset_prefix_cache())


def kv_cache_tensors(llm: Any) -> list[Any]:
    """The worker's KV cache tensors (one per attention layer; blocks on dim 0) of a
    single-process engine."""
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    tensors = []
    for layer in ctx.values():
        kv = getattr(layer, "kv_cache", None)
        if kv is None:
            continue
        if isinstance(kv, list | tuple):
            kv = kv[0]
        if hasattr(kv, "shape") and kv.numel():
            tensors.append(kv)
    return tensors


def corrupt_request_blocks(llm: Any, request_id: str, seed: int = 0) -> int:
    """Overwrite the KV blocks a request holds with noise (a negative control: a reader of
    these blocks gets garbage). Returns the number of blocks overwritten."""
    import torch

    sched = probe.scheduler(llm)
    block_ids = list(sched.kv_cache_manager.get_block_ids(request_id)[0])
    if not block_ids:
        return 0
    gen = torch.Generator().manual_seed(seed)
    index = torch.tensor(block_ids, dtype=torch.long)
    for kv in kv_cache_tensors(llm):
        noise = torch.randn(kv[index].shape, generator=gen, dtype=torch.float32) * 5
        kv[index] = noise.to(kv.dtype)
    return len(block_ids)
