"""Real vLLM servers on CPU for the proxy's engine tests: the kvcompose trees of examples/pd
(P: first[nixl, disk]; D: first[disk, nixl]), D's disk leaf replaced by the fault-injecting
double of the store (``kvcompose.testing.faulty_store``), helpers that read the servers.

D's local prefix cache is emptied (``POST /reset_prefix_cache``, vLLM's dev-mode route) after
D's disk tier has been warmed, so D's disk tier owns the next load of that prompt and an
injected failure fires for every faulty request, whichever D serves it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvcompose.proxy import ProxyConfig, create_app
from kvcompose.testing import faulty_store
from kvcompose.testing.pd_servers import VLLMServer, rendered_config
from kvcompose.testing.scripted_vllm import ServerThread

log = logging.getLogger("kvcompose.tests.proxy")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the tiny model has none
#: no CPU pinning: vLLM's default (``VLLM_CPU_OMP_THREADS_BIND=auto``) pins every server's
#: worker threads the same way, the helper threads (NIXL's, gloo's) of all servers to CPU 0,
#: where one spinning NIXL progress thread then starves the others (seen: one at 92 % of
#: CPU 0, the other servers' NIXL threads at 1 %, a hand-off stalled until P's lease ran out)
NO_PINNING = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
#: vLLM's dev-mode routes (``/reset_prefix_cache``) on the decode servers
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1", **NO_PINNING}
#: generous for a 2-core machine: the proxy's own defaults are for real deployments
TIMEOUTS = {"connect": 30, "read": 300, "health": 10}
#: the proxy's start: its lifespan asks every backend for /health and /v1/models, which a
#: busy server can take most of TIMEOUTS["health"] to answer (seen: over ServerThread's 20 s)
START_S = 120.0
KEYS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def prompt(seed: int, n: int = 150) -> list[int]:
    return [(seed * 131 + i * 17 + (i * i) % 13) % 1000 + 3 for i in range(n)]


def start(
    tiny_model: Path,
    tmp: Path,
    prefill: Iterable[str],
    decode: Iterable[str],
    fail_load_request_ids: list[str],
) -> dict[str, VLLMServer]:
    """Start the servers named (P ones with prefill.yaml, D ones with decode.yaml) and wait
    until they answer."""
    p_cfg = rendered_config(EXAMPLE / "prefill.yaml")
    d_cfg = rendered_config(EXAMPLE / "decode.yaml")
    p_leaf = p_cfg["kv_connector_extra_config"]["tree"]["chain"]["children"][1]["leaf"]
    p_leaf["extra_config"]["path"] = str(tmp / "p")
    disk = d_cfg["kv_connector_extra_config"]["tree"]["chain"]["children"][0]["leaf"]
    disk["connector"], disk["module_path"] = faulty_store.CONNECTOR, faulty_store.MODULE_PATH
    disk["extra_config"] = {"path": str(tmp / "d"), "fail_load_request_ids": fail_load_request_ids}
    (tmp / "chat.jinja").write_text(TEMPLATE)
    chat = ("--chat-template", str(tmp / "chat.jinja"))
    servers: dict[str, VLLMServer] = {}
    try:
        for name in prefill:
            servers[name] = VLLMServer(name, tiny_model, p_cfg, tmp, extra_args=chat,
                                       env=NO_PINNING)  # fmt: skip
        for name in decode:
            servers[name] = VLLMServer(name, tiny_model, d_cfg, tmp, extra_args=chat, env=DEV_MODE)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.wait_ready(), servers.values()))
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: dict[str, VLLMServer]) -> None:
    """Stop all servers at once (each waits for its processes to exit)."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(VLLMServer.stop, servers.values()))


def handshake(p: VLLMServer, d: VLLMServer, attempts: int = 3) -> None:
    """One direct hand-off P -> D: NIXL's first handshake (minutes on a loaded 2-core
    machine) stays out of the tests' timeouts. Tried again when D fails the request: D gives
    P's side channel 5 s to answer (``NixlConnectorWorker._nixl_handshake`` sets
    ``zmq.RCVTIMEO`` to 5000 ms), which a server starved of CPU while the others start can
    miss, and D then fails the load (seen: HTTP 500, every test of the module in error)."""
    for attempt in range(1, attempts + 1):
        with httpx.Client(timeout=600) as c:
            p_out = c.post(
                f"{p.url}/v1/completions",
                json={
                    "prompt": prompt(100 - attempt),
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            ).json()
            d_out = c.post(
                f"{d.url}/v1/completions",
                json={
                    "prompt": prompt(100 - attempt),
                    "max_tokens": 2,
                    "kv_transfer_params": p_out["kv_transfer_params"],
                },
            )
        if d_out.status_code == 200:
            return
        log.warning("%s -> %s: hand-off %d failed: %s", p.name, d.name, attempt, d_out.text)
    raise AssertionError(f"{p.name} -> {d.name}: no hand-off in {attempts} attempts")


def handshake_all(servers: dict[str, VLLMServer], prefill: list[str], decode: list[str]) -> None:
    """:func:`handshake` for every P and D, in rounds of disjoint pairs run side by side (a
    first hand-off mostly waits: P's first prefill, D's side-channel round trip, UCX's
    connection set-up)."""
    rounds = [[(p, decode[(i + k) % len(decode)]) for i, p in enumerate(prefill)]
              for k in range(len(decode))]  # fmt: skip
    with ThreadPoolExecutor(len(prefill)) as pool:
        for pairs in rounds:
            list(pool.map(lambda pd: handshake(servers[pd[0]], servers[pd[1]]), pairs))


def greedy(server: VLLMServer, seeds: Iterable[int], n: int, **kw: Any) -> dict[int, list[int]]:
    """One engine's greedy output, no hand-off (a P server serving the prompt itself)."""
    out = {}
    with httpx.Client(timeout=300) as c:
        for seed in seeds:
            data = c.post(
                f"{server.url}/v1/completions",
                json={
                    "prompt": prompt(seed),
                    "max_tokens": n,
                    "temperature": 0,
                    "return_token_ids": True,
                    **kw,
                },
            ).json()
            out[seed] = data["choices"][0]["token_ids"]
    return out


def direct(server: VLLMServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One engine's whole greedy answer to ``body`` at ``path``, no hand-off (a P server
    serving the request itself)."""
    resp = httpx.post(
        f"{server.url}{path}",
        json={**body, "stream": False, "temperature": 0, "return_token_ids": True},
        timeout=300,
    )
    assert resp.status_code == 200, (server.name, resp.status_code, resp.text)
    return resp.json()


def read_answer(events: list[dict[str, Any]]) -> tuple[str, list[int], list[int]]:
    """(text, token ids, prompt token ids) of one answer in vLLM's shapes: a whole response
    (``[response]``) or a stream's events; chat or completion."""
    text, ids, prompt_ids = [], [], []
    for event in events:
        prompt_ids.extend(event.get("prompt_token_ids") or ())  # chat
        for choice in event.get("choices") or ():
            part = choice.get("message") or choice.get("delta")
            text.append((part.get("content") if part else choice.get("text")) or "")
            ids.extend(choice.get("token_ids") or ())
            prompt_ids.extend(choice.get("prompt_token_ids") or ())  # completions
    return "".join(text), ids, prompt_ids


def reset_prefix_cache(servers: Iterable[VLLMServer]) -> None:
    """Empty the local prefix caches (not the connectors' stores): D's disk tier then owns
    the next load of a prompt it holds."""
    for s in servers:
        resp = httpx.post(f"{s.url}/reset_prefix_cache", timeout=60)
        assert resp.status_code == 200, (s.name, resp.status_code, resp.text)


def proxy(
    servers: dict[str, VLLMServer], prefill: Iterable[str], decode: Iterable[str], **kw: Any
) -> tuple[ServerThread, Any]:
    app = create_app(
        ProxyConfig(
            prefill=[servers[p].url for p in prefill],
            decode=[servers[d].url for d in decode],
            backoff_s=0.05,
            health_interval_s=0.5,
            timeouts=TIMEOUTS,
            **kw,
        )
    )
    return ServerThread(app).start(timeout=START_S), app


def idle(servers: dict[str, VLLMServer], timeout: float = 60.0) -> dict[str, dict[str, float]]:
    """Wait until no live server runs or waits on a request and none holds a KV block."""
    deadline = time.monotonic() + timeout
    while True:
        snap = {n: s.metrics() for n, s in servers.items() if s.proc.poll() is None}
        busy = {n: [m.get(k) for k in KEYS] for n, m in snap.items() if any(m.get(k) for k in KEYS)}
        if not busy:
            return snap
        assert time.monotonic() < deadline, f"still held after {timeout} s: {busy}"
        time.sleep(0.5)


def injected(servers: dict[str, VLLMServer], names: Iterable[str], marker: str) -> int:
    """Requests whose id contains ``marker`` that a decode server ended in an error: vLLM
    logs ``Request cmpl-<id> failed with an internal error during generation``
    (``GenerateBaseServing._raise_if_error``) when the injected load failure ends them."""
    return sum(
        1
        for d in names
        for line in servers[d].log_path.read_text(errors="replace").splitlines()
        if "failed with an internal error" in line and marker in line
    )


def retries(app: Any, cause: str) -> float:
    value = app.state.metrics.registry.get_sample_value(
        "kvcompose_proxy_retries_total", {"cause": cause}
    )
    return value or 0.0


def body(seed: int, n: int, **kw: Any) -> dict[str, Any]:
    return {
        "prompt": prompt(seed),
        "max_tokens": n,
        "temperature": 0,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **kw,
    }
