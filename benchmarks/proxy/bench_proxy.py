"""What ``kvcompose proxy`` costs on loopback, and how long it takes to recover from faults.

Against **scripted** vLLM servers (kvcompose.testing.scripted_vllm: no model compute, one
token per SSE chunk, no delay), so the figures are the proxy's own cost, not an engine's:

- added latency: a streamed 16-token completion through the proxy (tokenize on P, prefill
  on P, decode on D) against the same stream read from D directly, sequential requests;
- requests/s: 32 concurrent clients through the proxy process pinned to one core, as
  wall-clock rate and as requests per CPU-second the proxy process used;
- recovery: the latency of a request with one injected fault minus the median without,
  per fault kind (one P and one D, so every retry goes to the same pair).

    python benchmarks/proxy/bench_proxy.py [--requests 300] [--out benchmarks/results/proxy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvcompose.testing.ports import free_port
from kvcompose.testing.scripted_vllm import MODEL, Fabric, Fault, ScriptedVLLM, ServerThread

PROMPT = list(range(10, 138))  # 128 token ids
TOKENS = 16


async def _read(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.status_code
        async for _ in resp.aiter_lines():
            pass
    return time.perf_counter() - t0


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "stream": True, **kw}


def _start_proxy(prefill: list[str], decode: list[str], core: int) -> tuple[Any, str]:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "kvcompose.cli",
        "proxy",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--prefill",
        *prefill,
        "--decode",
        *decode,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(proc.pid, {core})
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the proxy did not start")


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "n": len(xs),
    }


async def latency(proxy: str, decode: str, n: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(20):  # warm connections on both paths
            await _read(c, f"{decode}/v1/completions", _body())
            await _read(c, f"{proxy}/v1/completions", _body())
        direct, proxied = [], []
        for _ in range(n):
            direct.append(await _read(c, f"{decode}/v1/completions", _body()))
            proxied.append(await _read(c, f"{proxy}/v1/completions", _body()))
    d, p = _pct(direct), _pct(proxied)
    return {
        "direct_to_decode": d,
        "through_proxy": p,
        "added_p50_ms": round(p["p50_ms"] - d["p50_ms"], 3),
        "added_p99_ms": round(p["p99_ms"] - d["p99_ms"], 3),
    }


async def throughput(proxy: str, total: int, concurrency: int, pid: int) -> dict[str, Any]:
    import psutil

    cpu = psutil.Process(pid)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:

        async def one() -> None:
            async with sem:
                await _read(c, f"{proxy}/v1/completions", _body())

        c0 = sum(cpu.cpu_times()[:2])
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(total)))
        wall = time.perf_counter() - t0
        busy = sum(cpu.cpu_times()[:2]) - c0
    # The client and the scripted servers share this machine's cores (and one Python
    # process), so the wall-clock rate is a floor; requests per CPU-second of the proxy
    # process is what one fully used core would sustain.
    return {
        "requests": total,
        "concurrency": concurrency,
        "seconds": round(wall, 2),
        "requests_per_s_wall": round(total / wall, 1),
        "proxy_cpu_seconds": round(busy, 2),
        "requests_per_proxy_cpu_second": round(total / busy, 1),
    }


async def recovery(proxy: str, p: ScriptedVLLM, d: ScriptedVLLM, runs: int) -> dict[str, Any]:
    kinds = {
        "decode load failure (error event)": (d, Fault("load_fail")),
        "decode stream dropped after 8 tokens": (d, Fault("drop", after=8)),
        "decode gave it back (recomputed) after 8": (d, Fault("recomputed", after=8)),
        "decode HTTP 500": (d, Fault("status", code=500)),
        "prefill HTTP 503": (p, Fault("status", code=503)),
    }
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=30) as c:
        base = [await _read(c, f"{proxy}/v1/completions", _body()) for _ in range(runs * 2)]
        median = statistics.median(base)
        out["no fault"] = {"median_ms": round(median * 1000, 3)}
        for name, (server, fault) in kinds.items():
            extra = []
            for _ in range(runs):
                server.fail_next(fault)
                extra.append(await _read(c, f"{proxy}/v1/completions", _body()) - median)
                await asyncio.sleep(0.3)  # let the health check put the backend back
            out[name] = {
                "added_median_ms": round(statistics.median(extra) * 1000, 3),
                "added_max_ms": round(max(extra) * 1000, 3),
            }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default="benchmarks/results/proxy")
    args = ap.parse_args()
    fabric = Fabric()
    servers = [ScriptedVLLM(n, fabric) for n in ("p1", "d1")]
    threads = [ServerThread(s.app).start() for s in servers]
    p_url, d_url = (t.url for t in threads)
    cores = sorted(os.sched_getaffinity(0))
    results: dict[str, Any] = {
        "what": "kvcompose proxy against scripted vLLM servers on loopback (no model compute)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other work, "
        f"Python {platform.python_version()}",
        "proxy_core": cores[-1],
        "tokens_per_request": TOKENS,
        "prompt_tokens": len(PROMPT),
    }
    proc, proxy = _start_proxy([p_url], [d_url], cores[-1])
    try:
        results["latency"] = asyncio.run(latency(proxy, d_url, args.requests))
        results["throughput"] = asyncio.run(throughput(proxy, args.requests * 3, 32, proc.pid))
        results["recovery"] = asyncio.run(recovery(proxy, servers[0], servers[1], 10))
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for t in threads:
            t.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
