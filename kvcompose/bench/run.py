"""``run_bench``: one workload against several chains, each in a fresh engine with fresh stores.

Steps:

1. build the model (``builtin``: see ``kvcompose.bench.model``) and the workload per seed;
2. resolve every chain (store placeholders → per-chain directories); a chain that cannot be
   resolved is reported as failed and the others still run;
3. prepare each store the workload fills (``fast``, ``disk``...) once per seed, in a separate
   engine whose only connector is that store's leaf;
4. for each seed and chain: copy the prepared stores into the chain's fresh directories, start a
   subprocess (``kvcompose.bench.runner``) with a single-process engine, warm it up, replay the
   workload, read back per-request timings and per-node/per-store counter deltas;
5. compare greedy outputs with the recompute chain, summarise, write ``results.json``,
   ``results.csv``, ``requests.csv``, the plots, and print the table.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.bench import chains as chainmod
from kvcompose.bench import metrics
from kvcompose.bench.model import EngineOptions, model_facts, resolve_model
from kvcompose.bench.runner import PROGRESS_PREFIX
from kvcompose.bench.workloads import (
    BUILTIN,
    ChatParams,
    DocQAParams,
    MooncakeParams,
    NoReuseParams,
    Workload,
    WorkloadError,
    chat_workload,
    docqa_workload,
    load_trace,
    noreuse_workload,
    token_block,
    write_trace,
)

#: Environment of every engine subprocess (set over the caller's unless noted).
RUNNER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # scheduler + worker in one process: stats readable
    "OMP_WAIT_POLICY": "PASSIVE",  # 10-30x faster on 2 cores
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
#: Set only when the caller has not set them.
RUNNER_ENV_DEFAULTS = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


class BenchError(RuntimeError):
    """The comparison cannot run at all (bad workload, no model...)."""


@dataclass
class BenchOptions:
    workload: str = "chat"  # chat | docqa | noreuse | PATH.jsonl | mooncake:PATH
    chains: list[str] = field(default_factory=list)  # empty: the default comparison
    model: str = "builtin"  # builtin | tiny | a model directory
    engine: EngineOptions = field(default_factory=EngineOptions)
    seeds: list[int] = field(default_factory=lambda: [0])
    out_dir: str = "kvcompose-bench"
    chat: ChatParams = field(default_factory=ChatParams)
    docqa: DocQAParams = field(default_factory=DocQAParams)
    noreuse: NoReuseParams = field(default_factory=NoReuseParams)
    mooncake: MooncakeParams = field(default_factory=MooncakeParams)
    trace_limit: int | None = None  # replay at most this many trace requests
    max_tokens: int | None = None  # override every request's output length
    time_scale: float = 1.0  # multiplier on arrival offsets (0: all at once)
    warmup_requests: int = 2
    prefill: bool = True  # fill the stores with the workload's prepared contents
    keep_stores: bool = False
    store_root: str | None = None  # default: <out_dir>/stores
    tmpfs_root: str | None = None  # default: /dev/shm (or the store root when missing)
    chain_timeout_s: float = 1800.0
    plots: bool = True
    progress: bool = True


# --------------------------------------------------------------------------- workload


def build_workload(opts: BenchOptions, vocab_size: int, seed: int) -> Workload:
    spec = opts.workload
    if spec == "chat":
        wl = chat_workload(opts.chat, vocab_size=vocab_size, seed=seed)
    elif spec == "docqa":
        wl = docqa_workload(opts.docqa, vocab_size=vocab_size, seed=seed)
    elif spec == "noreuse":
        wl = noreuse_workload(opts.noreuse, vocab_size=vocab_size, seed=seed)
    else:
        path = spec.split(":", 1)[1] if spec.startswith("mooncake:") else spec
        if not os.path.isfile(path):
            raise WorkloadError(f"workload {spec!r}: not one of {', '.join(BUILTIN)} and no "
                                "such file")
        wl = load_trace(path, vocab_size=vocab_size, seed=seed, limit=opts.trace_limit,
                        max_tokens=opts.max_tokens, mooncake=opts.mooncake)
    if opts.max_tokens is not None:
        for r in wl.requests:
            r.max_tokens = opts.max_tokens
    if opts.time_scale != 1.0:
        wl = wl.scaled(opts.time_scale)
    if not opts.prefill:
        wl.prefill = {}
    too_long = [r.id for r in wl.requests
                if len(r.prompt) + r.max_tokens > opts.engine.max_model_len]
    if too_long:
        raise WorkloadError(f"{len(too_long)} requests (e.g. {too_long[0]}) do not fit "
                            f"max_model_len {opts.engine.max_model_len}; raise "
                            "--max-model-len or shorten the workload")
    if not wl.requests:
        raise WorkloadError("the workload has no requests")
    return wl


def warmup_prompts(wl: Workload, n: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts unrelated to the workload (they share nothing with it), typical length."""
    lens = sorted(len(r.prompt) for r in wl.requests)
    length = lens[len(lens) // 2] if lens else 256
    return [token_block(f"warmup{i}", length, vocab_size=vocab_size, seed=seed + 7919)
            for i in range(n)]


# --------------------------------------------------------------------------- subprocesses


def _runner_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RUNNER_ENV)
    for k, v in RUNNER_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    return env


def run_job(job: dict[str, Any], job_dir: Path, *, timeout_s: float,
            on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``kvcompose.bench.runner`` on ``job``; return its result (``ok`` False on failure,
    with ``error`` and the log's tail)."""
    job_dir.mkdir(parents=True, exist_ok=True)
    job_file = job_dir / "job.json"
    result_file = job_dir / "result.json"
    log_file = job_dir / "engine.log"
    with contextlib.suppress(FileNotFoundError):
        result_file.unlink()
    job = {**job, "result_file": str(result_file)}
    job_file.write_text(json.dumps(job))
    lines: queue.Queue[str | None] = queue.Queue()
    with open(log_file, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcompose.bench.runner", str(job_file)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_runner_env(), text=True,
            bufsize=1, errors="replace")

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            while True:
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        timed_out = True
                        proc.kill()
                        break
                    continue
                if line is None:
                    break
                if line.startswith(PROGRESS_PREFIX):
                    if on_progress is not None:
                        with contextlib.suppress(ValueError):
                            on_progress(json.loads(line[len(PROGRESS_PREFIX):]))
                else:
                    log.write(line)
        finally:
            if proc.poll() is None and not timed_out:  # interrupted: take the engine down too
                proc.kill()
            rc = proc.wait()
            reader.join(timeout=5)
    result: dict[str, Any] = {}
    if result_file.exists():
        with contextlib.suppress(ValueError):
            result = json.loads(result_file.read_text())
    if timed_out:
        result = {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    elif not result:
        result = {"ok": False, "error": f"engine process exited with {rc} and no result"}
    if not result.get("ok"):
        result["log_tail"] = _tail(log_file, 30)
        result.setdefault("error", "failed")
    result["log"] = str(log_file)
    return result


def _tail(path: Path, n: int) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- stores


def _default_tmpfs_root() -> str | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm)
    return None


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- the run


@dataclass
class ChainRun:
    chain: chainmod.ChainDef
    resolved: chainmod.ResolvedChain | None = None
    error: str | None = None
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)  # seed -> runner result


class _Progress:
    """A rich progress display (or nothing)."""

    def __init__(self, enabled: bool, console: Any) -> None:
        self.enabled = enabled
        self.console = console
        self._progress: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=self.console, transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def add(self, description: str, total: int) -> Any:
        if self._progress is None:
            return None
        return self._progress.add_task(description, total=total)

    def update(self, task: Any, **kw: Any) -> None:
        if self._progress is not None and task is not None:
            self._progress.update(task, **kw)

    def log(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message)
        elif self.console is not None:
            self.console.print(message)


def run_bench(opts: BenchOptions, console: Any = None) -> dict[str, Any]:
    """Run the comparison; write everything under ``opts.out_dir``; return the results dict."""
    from kvcompose.bench import report

    t_start = time.perf_counter()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    out = Path(opts.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = resolve_model(opts.model)
    except FileNotFoundError as exc:
        raise BenchError(str(exc)) from None
    facts = model_facts(model_dir)
    vocab = facts["vocab_size"]

    # Chains.
    specs = list(opts.chains) or list(chainmod.DEFAULT_CHAINS)
    runs: list[ChainRun] = []
    for arg in specs:
        try:
            runs.append(ChainRun(chain=chainmod.parse_chain(arg)))
        except chainmod.ChainError as exc:
            runs.append(ChainRun(chain=chainmod.ChainDef(label=_label_of(arg), source=arg,
                                                         kind="invalid"), error=str(exc)))
    chainmod.unique_labels([r.chain for r in runs])
    if not opts.chains:
        chainmod.write_builtin_chains(out / "chains")
    store_root = Path(opts.store_root).resolve() if opts.store_root else out / "stores"
    tmpfs_base = opts.tmpfs_root or _default_tmpfs_root()
    tmp_owned = None
    if tmpfs_base:
        Path(tmpfs_base).mkdir(parents=True, exist_ok=True)
        tmp_owned = tempfile.mkdtemp(prefix="kvcompose-bench-", dir=tmpfs_base)
        tmpfs_root = tmp_owned
    else:
        tmpfs_root = str(store_root / "tmpfs")
    for run in runs:
        if run.error:
            continue
        try:
            run.resolved = chainmod.resolve(run.chain, out / "runs" / run.chain.label,
                                            disk_root=store_root / "chains",
                                            tmpfs_root=tmpfs_root)
        except Exception as exc:
            run.error = str(exc) if isinstance(exc, chainmod.ChainError) else (
                f"chain {run.chain.label!r}: {type(exc).__name__}: {exc}")

    # Workloads (one per seed).
    workloads: dict[int, Workload] = {}
    for seed in opts.seeds:
        try:
            workloads[seed] = build_workload(opts, vocab, seed)
        except WorkloadError as exc:
            raise BenchError(str(exc)) from None
    write_trace(workloads[opts.seeds[0]], out / "workload.jsonl")

    results: dict[str, Any] = {
        "meta": {
            "started": started, "kvcompose": _version("kvcompose"), "vllm": _version("vllm"),
            "torch": _version("torch"), "python": platform.python_version(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "model": {"spec": opts.model, "path": str(model_dir), **facts},
            "engine": opts.engine.to_dict(), "seeds": opts.seeds,
            "workload": workloads[opts.seeds[0]].summary(),
            "workload_description": workloads[opts.seeds[0]].description,
            "time_scale": opts.time_scale, "warmup_requests": opts.warmup_requests,
            "out_dir": str(out),
        },
        "prepare": {}, "chains": [],
    }

    n_jobs = len(opts.seeds) * (1 + sum(1 for r in runs if r.resolved is not None))
    previous = _exit_on_sigterm()
    try:
        with _Progress(opts.progress, console) as prog:
            overall = prog.add("kvcompose bench", n_jobs)
            for seed in opts.seeds:
                wl = workloads[seed]
                prepared = _prepare_stores(opts, runs, wl, seed, model_dir, out, store_root,
                                           prog, results)
                prog.update(overall, advance=1)
                wl_file = out / "runs" / f"workload-seed{seed}.json"
                wl_file.parent.mkdir(parents=True, exist_ok=True)
                wl_file.write_text(json.dumps(wl.to_dict()))
                warm = warmup_prompts(wl, opts.warmup_requests, vocab, seed)
                for run in runs:
                    if run.resolved is None:
                        continue
                    res = _run_chain(opts, run, wl, wl_file, warm, seed, model_dir, out,
                                     prepared, prog)
                    run.runs[seed] = res
                    prog.update(overall, advance=1)
                    if not res.get("ok"):
                        prog.log(f"[red]chain {run.chain.label!r} failed:[/red] "
                                 f"{res.get('error')} (log: {res.get('log')})")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if tmp_owned and not opts.keep_stores:
            shutil.rmtree(tmp_owned, ignore_errors=True)
        if not opts.keep_stores:
            shutil.rmtree(store_root / "chains", ignore_errors=True)
            shutil.rmtree(store_root / "prepared", ignore_errors=True)
            with contextlib.suppress(OSError):
                store_root.rmdir()

    results["chains"] = _summarise(runs, opts.seeds)
    results["goals"] = _goals(results["chains"])
    results["meta"]["duration_s"] = round(time.perf_counter() - t_start, 1)
    report.write_all(results, runs, out, plots=opts.plots)
    return results


def _exit_on_sigterm() -> Any:
    """Turn SIGTERM into ``SystemExit`` (main thread only), so that stores and the running
    engine are cleaned up; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _label_of(arg: str) -> str:
    head, sep, _ = arg.partition("=")
    return head if sep and head else Path(arg).stem or "chain"


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        for name in (dist, f"{dist}-cpu"):
            with contextlib.suppress(Exception):
                return version(name)
    except ImportError:  # pragma: no cover
        pass
    return None


def _prepare_stores(opts: BenchOptions, runs: list[ChainRun], wl: Workload, seed: int,
                    model_dir: Path, out: Path, store_root: Path, prog: _Progress,
                    results: dict[str, Any]) -> dict[tuple[str, str], str]:
    """Build every (store, variant) the workload fills, once; return their directories."""
    wanted: dict[tuple[str, str], chainmod.StoreLeaf] = {}
    for run in runs:
        if run.resolved is None:
            continue
        for leaf in run.resolved.store_leaves:
            if wl.prefill.get(leaf.store):
                wanted.setdefault((leaf.store, leaf.variant()), leaf)
    prepared: dict[tuple[str, str], str] = {}
    if not wanted:
        return prepared
    job_dir = out / "runs" / "_prepare" / f"seed{seed}"
    jobs = []
    for (name, variant), leaf in wanted.items():
        path = str(store_root / "prepared" / f"seed{seed}" / f"{name}-{variant}")
        _fresh_dir(path)
        prompts_file = job_dir / f"{name}-{variant}.prompts.json"
        prompts_file.parent.mkdir(parents=True, exist_ok=True)
        prompts_file.write_text(json.dumps(wl.prefill[name]))
        jobs.append({"name": f"{name}-{variant}", "path": path,
                     "kv_transfer_config": leaf.prep_config(path),
                     "prompts_file": str(prompts_file)})
        prepared[(name, variant)] = path
    task = prog.add(f"seed {seed}: preparing stores {', '.join(sorted(n for n, _ in wanted))}",
                    len(jobs))

    def on_progress(msg: dict[str, Any]) -> None:
        prog.update(task, completed=msg.get("done", 0))

    job = {"mode": "prefill", "model": str(model_dir),
           "engine": opts.engine.llm_kwargs(seed), "stores": jobs}
    res = run_job(job, job_dir, timeout_s=opts.chain_timeout_s, on_progress=on_progress)
    prog.update(task, completed=len(jobs))
    results["prepare"][f"seed{seed}"] = {k: v for k, v in res.items() if k != "log_tail"}
    if not res.get("ok"):
        prog.log(f"[red]preparing the stores failed:[/red] {res.get('error')} "
                 f"(log: {res.get('log')}); chains start with empty stores")
        return {}
    return prepared


def _run_chain(opts: BenchOptions, run: ChainRun, wl: Workload, wl_file: Path,
               warm: list[list[int]], seed: int, model_dir: Path, out: Path,
               prepared: dict[tuple[str, str], str], prog: _Progress) -> dict[str, Any]:
    resolved = run.resolved
    assert resolved is not None
    variants = {leaf.store: leaf.variant() for leaf in resolved.store_leaves}
    for name, path in resolved.stores.items():
        _fresh_dir(path)
        src = prepared.get((name, variants.get(name, "")))
        if src and os.path.isdir(src):
            shutil.copytree(src, path)
        else:
            os.makedirs(path, exist_ok=True)
    task = prog.add(f"seed {seed}: {run.chain.label}", len(wl.requests))

    def on_progress(msg: dict[str, Any]) -> None:
        if msg.get("phase") == "replay":
            prog.update(task, completed=msg.get("done", 0))
        elif msg.get("phase") in ("start", "warmup"):
            prog.update(task, description=f"seed {seed}: {run.chain.label} "
                                          f"({msg['phase']})")
        if msg.get("phase") == "replay":
            prog.update(task, description=f"seed {seed}: {run.chain.label}")

    job = {"mode": "measure", "label": run.chain.label, "seed": seed, "model": str(model_dir),
           "engine": opts.engine.llm_kwargs(seed),
           "kv_transfer_config": resolved.kv_transfer_config, "workload_file": str(wl_file),
           "warmup": warm, "stores": resolved.stores, "timeout_s": opts.chain_timeout_s}
    res = run_job(job, out / "runs" / run.chain.label / f"seed{seed}",
                  timeout_s=opts.chain_timeout_s + 120, on_progress=on_progress)
    if not opts.keep_stores:
        for path in resolved.stores.values():
            shutil.rmtree(path, ignore_errors=True)
    return res


# --------------------------------------------------------------------------- summary


def _pooled(run: ChainRun, seeds: list[int]) -> list[dict[str, Any]]:
    recs = []
    for seed in seeds:
        res = run.runs.get(seed)
        if not res or not res.get("ok"):
            continue
        for r in res["requests"]:
            rid = r["id"] if len(seeds) == 1 else f"s{seed}/{r['id']}"
            recs.append({**r, "id": rid, "seed": seed})
    return recs


def _summarise(runs: list[ChainRun], seeds: list[int]) -> list[dict[str, Any]]:
    reference = next((r for r in runs if r.chain.kind == "none" and r.runs
                      and all(x.get("ok") for x in r.runs.values())), None)
    ref_recs = _pooled(reference, seeds) if reference else None
    out = []
    for run in runs:
        entry: dict[str, Any] = {
            "label": run.chain.label, "source": run.chain.source, "kind": run.chain.kind,
            "description": run.chain.description,
            "connector": run.resolved.connector if run.resolved else None,
            "policy": _policy(run),
            "kv_transfer_config": run.resolved.kv_transfer_config if run.resolved else None,
        }
        failed = {s: r for s, r in run.runs.items() if not r.get("ok")}
        if run.error or not run.runs or len(failed) == len(run.runs):
            entry["status"] = "failed"
            first = next(iter(failed.values()), {})
            entry["error"] = run.error or first.get("error") or "did not run"
            if first.get("log"):
                entry["log"] = first["log"]
            out.append(entry)
            continue
        entry["status"] = "ok" if not failed else "partial"
        if failed:
            entry["error"] = "; ".join(f"seed {s}: {r.get('error')}" for s, r in failed.items())
        recs = _pooled(run, seeds)
        entry["latency"] = metrics.latency_summary(recs)
        per_seed = [metrics.throughput(r["requests"]) for r in run.runs.values() if r.get("ok")]
        entry["throughput"] = {k: metrics.mean([p[k] for p in per_seed if p[k] is not None])
                               for k in per_seed[0]}
        hits = [metrics.hit_summary(r) for r in run.runs.values() if r.get("ok")]
        entry["hits"] = _merge_hits(hits)
        entry["timings"] = {k: metrics.mean([r.get(k) for r in run.runs.values() if r.get("ok")])
                            for k in ("engine_start_s", "warmup_s", "replay_s", "total_s")}
        if ref_recs is not None:
            entry["agreement"] = metrics.agreement(recs, ref_recs)
            entry["agreement"]["reference"] = reference.chain.label if reference else None
        leftovers = [r.get("live_requests_after") for r in run.runs.values() if r.get("ok")]
        if any(leftovers):
            entry["live_requests_after"] = leftovers
        entry["requests"] = [
            {"id": r["id"], "seed": r["seed"], "prompt_tokens": r["prompt_tokens"],
             "cached_tokens": r.get("num_cached_tokens", 0),
             "output_tokens": len(r["output_token_ids"]), **metrics.request_latencies(r),
             "arrival_s": r["arrival_s"]} for r in recs]
        out.append(entry)
    ref_p50 = None
    for e in out:
        if reference and e["label"] == reference.chain.label and e.get("latency"):
            ref_p50 = e["latency"]["ttft_p50_s"]
    for e in out:
        lat = e.get("latency")
        if lat and ref_p50 and lat.get("ttft_p50_s"):
            e["ttft_p50_speedup"] = round(ref_p50 / lat["ttft_p50_s"], 2)
    return out


def _policy(run: ChainRun) -> str | None:
    tree = run.resolved.tree if run.resolved else None
    if tree is None:
        if run.resolved and run.resolved.connector == "MultiConnector":
            return "first (MultiConnector)"
        return None
    return getattr(tree, "policy", None) or getattr(tree, "kind", None)


def _merge_hits(hits: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum hit summaries over seeds."""
    if len(hits) == 1:
        return hits[0]
    merged: dict[str, Any] = {"stores": {}, "nodes": {}, "cached_tokens": 0, "tokens_loaded": 0,
                              "bytes_written": 0, "requests_with_cached_tokens": 0}
    for h in hits:
        for k in ("cached_tokens", "tokens_loaded", "bytes_written",
                  "requests_with_cached_tokens"):
            merged[k] += h[k]
        for name, s in h["stores"].items():
            dst = merged["stores"].setdefault(name, {k: 0 for k in s})
            for k, v in s.items():
                dst[k] = (dst.get(k) or 0) + (v or 0)
        for name, n in h["nodes"].items():
            dst = merged["nodes"].setdefault(name, {"policy": n["policy"], "lookups": 0,
                                                    "children": {}, "other_counters": {}})
            dst["lookups"] += n["lookups"]
            for c, v in n["children"].items():
                d = dst["children"].setdefault(c, {"hits": 0, "hit_tokens": 0})
                d["hits"] += v["hits"]
                d["hit_tokens"] += v["hit_tokens"]
            for k, v in n["other_counters"].items():
                dst["other_counters"][k] = dst["other_counters"].get(k, 0) + v
    return merged


def _goals(chains: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, measured (only those this chain set can answer)."""
    ok = [c for c in chains if c.get("status") in ("ok", "partial")]
    goals: dict[str, Any] = {}
    speedups = {c["label"]: c["ttft_p50_speedup"] for c in ok
                if c.get("ttft_p50_speedup") and c["kind"] != "none"}
    if speedups:
        best = max(speedups, key=lambda k: speedups[k])
        goals["tier_ttft_p50_speedup"] = {"target": 5.0, "best_chain": best,
                                          "best": speedups[best], "by_chain": speedups,
                                          "met": speedups[best] >= 5.0}
    multi = [c for c in ok if c.get("connector") == "MultiConnector" and c["kind"] == "vllm"]
    longest = [c for c in ok if c["kind"] == "kvcompose" and c.get("policy") == "longest"]
    if multi and longest:
        m, lg = multi[0], longest[0]
        mt, lt = m["hits"]["tokens_loaded"], lg["hits"]["tokens_loaded"]
        goals["longest_vs_multiconnector_hit_tokens"] = {
            "multiconnector": m["label"], "longest": lg["label"],
            "multiconnector_tokens": mt, "longest_tokens": lt,
            "ratio": round(lt / mt, 3) if mt else None,
            "met": lt >= mt, "strictly_more": lt > mt}
    agree = {c["label"]: c["agreement"]["percent"] for c in ok if c.get("agreement")}
    if agree:
        goals["output_agreement_percent"] = {
            "target": 100.0, "by_chain": agree,
            "met": all(v == 100.0 for v in agree.values())}
    failed = [c["label"] for c in chains if c.get("status") == "failed"]
    if failed:
        goals["failed_chains"] = failed
    return goals


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    keys: list[str] = []
    for row in rows:
        for k in row:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for row in rows:
            w.writerow(row)


__all__ = ["BenchError", "BenchOptions", "run_bench"]
