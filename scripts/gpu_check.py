"""The one-go GPU check behind ``scripts/gpu-check.sh``: NIXL P/D with LMCache on D.

A script, not library code: ``scripts/gpu-check.sh`` runs it as ``python
scripts/gpu_check.py`` with the checkout on ``PYTHONPATH``.

NOT YET RUN ON A GPU: written on CPU-only machines, where LMCache cannot store or load. The
parts that need no GPU (arguments, configs, commands, the workload, reading the metrics)
are checked by ``tests/test_gpu_check.py``; the run itself has never happened.

What it does, on one GPU, in this order:

1. **baseline**: one vLLM engine without a connector serves the workload (greedy);
2. **P/D**: a prefill engine P (a kvcompose tree: ``NixlConnector``) and a decode engine D
   (``chain [nixl, lmcache]``: NIXL pulls from P, LMCache offloads D's KV to CPU) share the
   GPU. Round 1 sends every request to P (``max_tokens: 1``, ``do_remote_decode``), then to
   D with P's ``kv_transfer_params``; round 2 sends the same prompts to D alone (D's prefix
   cache is off, so they come from LMCache's CPU tier);
3. checks: every output of both rounds equals the baseline's; P's KV-cache usage returns to
   0 (P freed its blocks once D read them); kvcompose's per-child hit tokens on D
   (``vllm:kvcompose_hit_tokens_total``) show NIXL in round 1 and LMCache in round 2;
4. **hybrid model** (unless ``--skip-hybrid``): kvcompose's tiny hybrid Llama (every other
   layer sliding over 64 tokens: two KV cache groups under vLLM's hybrid KV cache manager),
   a baseline engine, then one engine whose kvcompose tree (``hma: true``, so
   ``KVComposeHMA``) holds vLLM's real ``OffloadingConnector`` (GPU to CPU). Round 1 computes
   the prompts and offloads their KV to CPU; round 2 sends them again (prefix cache off):
   they load from the CPU tier. Checks: both rounds' outputs equal the hybrid baseline's, the
   offload child hits in round 2, and vLLM did not turn its hybrid KV cache manager off;
   all printed. Exit status 0 when every check passes.

The workload is prefix-heavy: ``--requests`` prompts sharing a ``--prefix-tokens`` prefix,
each with its own ``--suffix-tokens`` tail, as token ids (no tokenizer involved).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcompose.config import load_config
from kvcompose.config.render import to_json, vllm_args

#: vLLM's OpenAI server, as ``vllm serve`` runs it.
SERVER = ("-m", "vllm.entrypoints.openai.api_server")


@dataclass(frozen=True)
class Options:
    model: str
    python: str
    requests: int
    prefix_tokens: int
    suffix_tokens: int
    max_tokens: int
    gpu_memory_utilization: float
    dtype: str
    max_model_len: int
    chunk_size: int
    lmcache_cpu_gb: float
    lmcache_adapter: str
    base_port: int
    logs: Path
    start_timeout_s: float
    free_timeout_s: float
    dry_run: bool
    hybrid_model: str
    offload_cpu_gb: float
    skip_hybrid: bool

    @property
    def ports(self) -> dict[str, int]:
        b = self.base_port
        return {
            "baseline": b,
            "prefill": b + 1,
            "decode": b + 2,
            "hybrid_baseline": b + 3,
            "hybrid_offload": b + 4,
            "p_nixl": b + 11,
            "d_nixl": b + 12,
        }


def parse_args(argv: Sequence[str] | None = None) -> Options:
    ap = argparse.ArgumentParser(
        prog="gpu-check",
        description="NIXL P/D with LMCache's CPU offload on D under kvcompose, then the hybrid "
        "model with vLLM's OffloadingConnector under KVComposeHMA, on one GPU.",
    )
    ap.add_argument("--model", default="", help="model (default: kvcompose's tiny model)")
    ap.add_argument("--python", default=sys.executable, help="Python with vLLM, LMCache, NIXL")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="per engine (two share it)"
    )
    ap.add_argument("--dtype", default="float16", help="vLLM --dtype (auto for real models)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=64, help="LMCache chunk size (tokens)")
    ap.add_argument("--lmcache-cpu-gb", type=float, default=2.0)
    ap.add_argument(
        "--lmcache-adapter",
        choices=("native", "lmcache"),
        default="native",
        help="native: vLLM's vendored adapter (use_native); lmcache: LMCache's own",
    )
    ap.add_argument("--base-port", type=int, default=8300)
    ap.add_argument("--logs", type=Path, default=Path("/tmp/kvcompose-gpu-check"))
    ap.add_argument("--start-timeout-s", type=float, default=240.0)
    ap.add_argument("--free-timeout-s", type=float, default=60.0)
    ap.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    ap.add_argument(
        "--hybrid-model", default="", help="hybrid model (default: kvcompose's tiny-hybrid)"
    )
    ap.add_argument("--offload-cpu-gb", type=float, default=1.0, help="OffloadingConnector's CPU")
    ap.add_argument("--skip-hybrid", action="store_true", help="no hybrid-model phase")
    a = ap.parse_args(argv)
    if a.offload_cpu_gb <= 0:
        ap.error("--offload-cpu-gb must be positive")
    for name in ("requests", "prefix_tokens", "suffix_tokens", "max_tokens", "chunk_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.05 <= a.gpu_memory_utilization <= 0.45:
        ap.error("--gpu-memory-utilization is per engine: two must fit, keep it in [0.05, 0.45]")
    if a.prefix_tokens + a.suffix_tokens + a.max_tokens > a.max_model_len:
        ap.error("prompt plus output is longer than --max-model-len")
    return Options(**vars(a))


# ------------------------------------------------------------------------- configs
def prefill_document() -> dict[str, Any]:
    return {
        "version": 1,
        "kv_role": "kv_producer",
        "tree": {"chain": {"name": "prefill", "children": [{"leaf": _nixl()}]}},
    }


def decode_document(opts: Options) -> dict[str, Any]:
    lmcache: dict[str, Any] = {
        "name": "lmcache",
        "connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",  # LMCache saves nothing as a kv_consumer
    }
    if opts.lmcache_adapter == "native":
        lmcache["extra_config"] = {"use_native": True}
    return {
        "version": 1,
        "kv_role": "kv_consumer",
        "tree": {
            "chain": {
                "name": "decode",
                "policy": "first",  # NIXL first: a remote prefill is never lost to LMCache
                "children": [{"leaf": _nixl()}, {"leaf": lmcache}],
            }
        },
    }


def offload_document(opts: Options) -> dict[str, Any]:
    """The hybrid phase's tree: vLLM's OffloadingConnector (GPU to CPU) alone in a chain,
    with HMA required (``KVComposeHMA``): vLLM keeps its hybrid KV cache manager on."""
    cpu = {
        "name": "cpu",
        "connector": "OffloadingConnector",
        "extra_config": {"cpu_bytes_to_use": int(opts.offload_cpu_gb * 2**30)},
    }
    return {
        "version": 1,
        "kv_role": "kv_both",
        "hma": True,
        "tree": {"chain": {"name": "offload", "children": [{"leaf": cpu}]}},
    }


def _nixl() -> dict[str, Any]:
    return {"name": "nixl", "connector": "NixlConnector", "extra_config": {"backends": ["UCX"]}}


def kv_transfer_config(document: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for a document, checked by kvcompose (offline: the
    machine that writes it need not have vLLM)."""
    return vllm_args(load_config(document, env={}, check_vllm=False))


def lmcache_env(opts: Options) -> dict[str, str]:
    """LMCache's configuration through its environment variables: a CPU tier only."""
    return {
        "LMCACHE_CHUNK_SIZE": str(opts.chunk_size),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{opts.lmcache_cpu_gb:g}",
        "LMCACHE_SAVE_UNFULL_CHUNK": "False",
        "PYTHONHASHSEED": "0",
    }


@dataclass(frozen=True)
class Engine:
    name: str
    port: int
    argv: list[str]
    env: dict[str, str]


def engines(opts: Options, model: str, hybrid_model: str | None = None) -> dict[str, Engine]:
    """The engines of the check, in the order they run (the hybrid phase's only with
    ``hybrid_model``)."""

    def argv(port: int, *extra: str, served: str = model) -> list[str]:
        return [
            opts.python,
            *SERVER,
            "--model",
            served,
            "--port",
            str(port),
            "--gpu-memory-utilization",
            f"{opts.gpu_memory_utilization:g}",
            "--dtype",
            opts.dtype,
            "--max-model-len",
            str(opts.max_model_len),
            "--enforce-eager",
            "--no-enable-prefix-caching",  # every reuse must come through a connector
            *extra,
        ]

    ports = opts.ports
    p_cfg = to_json(kv_transfer_config(prefill_document()))
    d_cfg = to_json(kv_transfer_config(decode_document(opts)))
    plan = {
        "baseline": Engine("baseline", ports["baseline"], argv(ports["baseline"]), {}),
        "prefill": Engine(
            "prefill",
            ports["prefill"],
            argv(ports["prefill"], "--kv-transfer-config", p_cfg),
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports["p_nixl"])},
        ),
        "decode": Engine(
            "decode",
            ports["decode"],
            argv(ports["decode"], "--kv-transfer-config", d_cfg),
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports["d_nixl"]), **lmcache_env(opts)},
        ),
    }
    if hybrid_model is not None:
        offload = to_json(kv_transfer_config(offload_document(opts)))
        for name, key, extra in (
            ("hybrid-baseline", "hybrid_baseline", ()),
            ("hybrid-offload", "hybrid_offload", ("--kv-transfer-config", offload)),
        ):
            cmd = argv(ports[key], *extra, served=hybrid_model)
            plan[name] = Engine(name, ports[key], cmd, {})
    return plan


# ------------------------------------------------------------------------ workload
def prompts(opts: Options, vocab: int = 1000) -> list[list[int]]:
    """Prompts sharing one prefix, each with its own tail (ids above the special tokens)."""
    prefix = [4 + (37 * i + (i * i) % 7) % (vocab - 4) for i in range(opts.prefix_tokens)]
    return [
        prefix + [4 + (101 * (k + 1) + 13 * i) % (vocab - 4) for i in range(opts.suffix_tokens)]
        for k in range(opts.requests)
    ]


def completion(prompt: list[int], max_tokens: int, params: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def counters(metrics_text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Prometheus text: every sample of ``name``, by its labels (sorted)."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{(.*)\}})?\s+(\S+)$")
    for line in metrics_text.splitlines():
        match = pattern.match(line)
        if match:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")))
            out[labels] = float(match.group(2))
    return out


def hit_tokens_by_child(metrics_text: str) -> dict[str, float]:
    total: dict[str, float] = {}
    for labels, value in counters(metrics_text, "vllm:kvcompose_hit_tokens_total").items():
        child = dict(labels).get("child", "?")
        total[child] = total.get(child, 0.0) + value
    return total


def kv_cache_usage(metrics_text: str) -> float:
    return sum(counters(metrics_text, "vllm:kv_cache_usage_perc").values())


# ----------------------------------------------------------------------------- run
def _http(url: str, body: dict | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if body is not None else raw


@contextmanager
def running(engine: Engine, opts: Options) -> Iterator[str]:
    opts.logs.mkdir(parents=True, exist_ok=True)
    log = (opts.logs / f"{engine.name}.log").open("w")
    proc = subprocess.Popen(
        engine.argv, env={**os.environ, **engine.env}, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{engine.port}"
    try:
        deadline = time.monotonic() + opts.start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{engine.name} exited; see {log.name}")
            try:
                _http(f"{url}/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{engine.name} did not start; see {log.name}") from None
                time.sleep(2)
        print(f"[gpu-check] {engine.name} up on {url}", flush=True)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def text_of(response: dict) -> str:
    return response["choices"][0]["text"]


def run(opts: Options) -> int:
    model = opts.model or _tiny_model(opts.python)
    hybrid_model = None if opts.skip_hybrid else opts.hybrid_model or _tiny_model(opts.python, True)
    plan = engines(opts, model, hybrid_model)
    work = prompts(opts)
    if opts.dry_run:
        for engine in plan.values():
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in engine.env.items())
            print(f"[gpu-check] {engine.name}: {env} {shlex.join(engine.argv)}".replace("  ", " "))
        print(f"[gpu-check] workload: {len(work)} prompts of {len(work[0])} tokens")
        return 0
    t0 = time.monotonic()
    with running(plan["baseline"], opts) as url:
        baseline = [
            text_of(_http(f"{url}/v1/completions", completion(p, opts.max_tokens))) for p in work
        ]
    failures: list[str] = []
    with running(plan["prefill"], opts) as p_url, running(plan["decode"], opts) as d_url:
        for i, prompt in enumerate(work):  # round 1: P prefills, D pulls over NIXL
            first = _http(
                f"{p_url}/v1/completions", completion(prompt, 1, {"do_remote_decode": True})
            )
            params = first.get("kv_transfer_params")
            if not params:
                failures.append(f"round 1 request {i}: P returned no kv_transfer_params")
                continue
            out = text_of(
                _http(f"{d_url}/v1/completions", completion(prompt, opts.max_tokens, params))
            )
            if out != baseline[i]:
                failures.append(f"round 1 request {i}: {out!r} != baseline {baseline[i]!r}")
        after_round1 = hit_tokens_by_child(_http(f"{d_url}/metrics"))
        deadline = time.monotonic() + opts.free_timeout_s
        usage = kv_cache_usage(_http(f"{p_url}/metrics"))
        while usage > 0 and time.monotonic() < deadline:
            time.sleep(1)
            usage = kv_cache_usage(_http(f"{p_url}/metrics"))
        if usage > 0:
            failures.append(f"P still holds KV blocks {opts.free_timeout_s:g}s later ({usage:.3f})")
        for i, prompt in enumerate(work):  # round 2: D alone, from LMCache's CPU tier
            out = text_of(_http(f"{d_url}/v1/completions", completion(prompt, opts.max_tokens)))
            if out != baseline[i]:
                failures.append(f"round 2 request {i}: {out!r} != baseline {baseline[i]!r}")
        after_round2 = hit_tokens_by_child(_http(f"{d_url}/metrics"))
    round2 = {k: v - after_round1.get(k, 0.0) for k, v in after_round2.items()}
    print(f"[gpu-check] D hit tokens by tier, round 1 (P/D): {after_round1}")
    print(f"[gpu-check] D hit tokens by tier, round 2 (D alone): {round2}")
    print(f"[gpu-check] P KV-cache usage after round 1: {usage:.3f}")
    if not after_round1.get("nixl"):
        failures.append("round 1: no tokens loaded through NIXL")
    if not round2.get("lmcache"):
        failures.append("round 2: no tokens loaded from LMCache")
    if hybrid_model is not None:
        failures += hybrid_phase(plan, opts, work)
    for failure in failures:
        print(f"[gpu-check] FAIL: {failure}")
    verdict = "PASS" if not failures else "FAIL"
    print(f"[gpu-check] {verdict} in {time.monotonic() - t0:.0f} s (logs: {opts.logs})")
    return 0 if not failures else 1


#: What vLLM logs when it turns its hybrid KV cache manager off for a connector
#: (``VllmConfig``'s hybrid KV cache manager check).
HMA_OFF = "Turning off hybrid kv cache manager"


def hybrid_phase(plan: dict[str, Engine], opts: Options, work: list[list[int]]) -> list[str]:
    """The hybrid model: a baseline, then the offload tree computing (round 1) and loading
    from CPU (round 2) the same prompts. Returns the failures."""
    failures: list[str] = []
    with running(plan["hybrid-baseline"], opts) as url:
        baseline = [
            text_of(_http(f"{url}/v1/completions", completion(p, opts.max_tokens))) for p in work
        ]
    engine = plan["hybrid-offload"]
    with running(engine, opts) as url:
        hits: list[dict[str, float]] = []
        for round_no in (1, 2):
            for i, prompt in enumerate(work):
                out = text_of(_http(f"{url}/v1/completions", completion(prompt, opts.max_tokens)))
                if out != baseline[i]:
                    failures.append(
                        f"hybrid round {round_no} request {i}: {out!r} != baseline {baseline[i]!r}"
                    )
            hits.append(hit_tokens_by_child(_http(f"{url}/metrics")))
    round2 = {k: v - hits[0].get(k, 0.0) for k, v in hits[1].items()}
    print(f"[gpu-check] hybrid offload hit tokens, round 1: {hits[0]}, round 2: {round2}")
    if not round2.get("cpu"):
        failures.append("hybrid round 2: no tokens loaded from the OffloadingConnector")
    if HMA_OFF in (opts.logs / f"{engine.name}.log").read_text(errors="replace"):
        failures.append("hybrid: vLLM turned its hybrid KV cache manager off")
    return failures


def _tiny_model(python: str, hybrid: bool = False) -> str:
    """kvcompose's tiny model (or its hybrid variant), built by ``python``."""
    code = "from kvcompose.engine.model import tiny_hybrid_model as m; print(m())"
    cmd = [python, "-c", code] if hybrid else [python, "-m", "kvcompose.engine.model"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        return run(opts)
    except (RuntimeError, OSError, KeyError, subprocess.CalledProcessError) as exc:
        print(f"[gpu-check] FAIL: {type(exc).__name__}: {exc} (logs: {opts.logs})", flush=True)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
