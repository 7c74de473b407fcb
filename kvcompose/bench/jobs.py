"""The bench's engine processes: preparing a store, measuring a contender.

Every engine runs in its own process (``kvcompose.engine.process.EngineProcess``) with its log
in ``engine.log`` of its run directory; what it runs is in ``kvcompose.bench.replay``. The
processes fork from a server that has imported vLLM once (``preloaded``): a run starts one
engine per contender and round, and importing vLLM again in each took most of its start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import Progress

from kvcompose.bench import contenders as cmod
from kvcompose.bench.options import BenchOptions
from kvcompose.bench.replay import round_s
from kvcompose.bench.results import BenchResults, PreparedStore, PrepareResult, RunResult
from kvcompose.bench.summary import Contender
from kvcompose.bench.workloads import Workload
from kvcompose.engine.process import EngineError, EngineProcess

#: Environment of every engine process, set over the caller's: scheduler and worker in one
#: process (their connectors readable), passive OpenMP threads (10-30x faster on 2 cores).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# --------------------------------------------------------------------------- engines


def _engine_env() -> dict[str, str]:
    return {**ENGINE_ENV, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}


@contextlib.contextmanager
def _engine(
    opts: BenchOptions,
    model_dir: Path,
    ktc: dict[str, Any] | None,
    seed: int,
    run_dir: Path,
    name: str,
    on_progress: Any = None,
    graceful: bool = True,
) -> Iterator[EngineProcess]:
    """An engine process for one job; ``graceful=False`` ends it without the engine's own
    shutdown (a measured run: its stores are thrown away, its counters already read)."""
    timeout = opts.contender_timeout_s
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = EngineProcess(
        model_dir,
        ktc,
        name=name,
        env=_engine_env(),
        llm_kwargs={**opts.engine.llm_kwargs(seed), "disable_log_stats": True},
        log_file=run_dir / "engine.log",
        on_progress=on_progress,
        start_timeout=timeout,
        call_timeout=timeout,
        preloaded=True,
    )
    try:
        yield proc
    finally:
        proc.close(graceful=graceful)


def _failure(exc: BaseException, log: Path) -> tuple[str, str]:
    """A short error and the log's tail."""
    if isinstance(exc, EngineError):
        error = exc.summary
    elif isinstance(exc, TimeoutError):
        error = f"timed out: {exc}"
    else:
        error = f"{type(exc).__name__}: {exc}"
    try:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
    except OSError:
        tail = ""
    return error, tail


# --------------------------------------------------------------------------- stores


def default_tmpfs_root() -> str | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm)
    return None


def _fresh_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)


@dataclass
class Session:
    """What the phases of one run share."""

    opts: BenchOptions
    model_dir: Path
    out: Path
    store_root: Path
    progress: Progress  # bars (disabled when not on a terminal)

    def log(self, message: str) -> None:
        """A message that is always shown (failures)."""
        self.progress.console.print(message)

    def note(self, message: str) -> None:
        """A progress line: one per prepared store set and per run, unless progress is off."""
        if self.opts.progress:
            self.progress.console.print(message, markup=False, highlight=False)

    def where(self, seed: int, round_no: int) -> str:
        """``round 2/3`` (and the seed when there are several)."""
        text = f"round {round_no + 1}/{self.opts.repeats}"
        return f"seed {seed} {text}" if len(self.opts.seeds) > 1 else text


def prepare_stores(
    run: Session, contenders: list[Contender], wl: Workload, seed: int, results: BenchResults
) -> dict[tuple[str, str], str]:
    """Build every (store, variant) the workload fills, once; return their directories."""
    wanted: dict[tuple[str, str], cmod.StoreLeaf] = {}
    for c in contenders:
        assert c.resolved is not None
        for leaf in c.resolved.store_leaves:
            if wl.prefill.get(leaf.store):
                wanted.setdefault((leaf.store, leaf.variant()), leaf)
    if not wanted:
        return {}
    job_dir = run.out / "runs" / "_prepare" / f"seed{seed}"
    task = run.progress.add_task(
        f"seed {seed}: preparing stores {', '.join(sorted(n for n, _ in wanted))}",
        total=len(wanted),
    )
    prepared: dict[tuple[str, str], str] = {}
    outcome = PrepareResult(log=str(job_dir))
    results.prepare[f"seed{seed}"] = outcome
    for (name, variant), leaf in wanted.items():
        path = str(run.store_root / "prepared" / f"seed{seed}" / f"{name}-{variant}")
        _fresh_dir(path)
        log_dir = job_dir / f"{name}-{variant}"
        t = time.perf_counter()
        try:
            with _engine(
                run.opts, run.model_dir, leaf.prep_config(path), seed, log_dir, f"prepare-{name}"
            ) as proc:
                proc.call("kvcompose.bench.replay:prefill", wl.prefill[name])
        except (EngineError, TimeoutError) as exc:
            outcome.error, _ = _failure(exc, log_dir / "engine.log")
            run.log(
                f"[red]preparing the stores failed:[/red] {escape(outcome.error or '')} "
                f"(log: {escape(str(log_dir / 'engine.log'))}); contenders start with empty stores"
            )
            return {}
        from kvcompose.stores import store_usage

        outcome.stores[f"{name}-{variant}"] = PreparedStore(
            seconds=round_s(time.perf_counter() - t),
            prompts=len(wl.prefill[name]),
            usage=store_usage(path),
        )
        prepared[(name, variant)] = path
        run.progress.advance(task)
        run.note(
            f"store {name} prepared for seed {seed}: {len(wl.prefill[name])} prompts, "
            f"{time.perf_counter() - t:.0f} s"
        )
    run.progress.remove_task(task)
    outcome.ok = True
    return prepared


def run_contender(
    run: Session,
    c: Contender,
    wl: Workload,
    warm: list[list[int]],
    seed: int,
    round_no: int,
    prepared: dict[tuple[str, str], str],
) -> RunResult:
    resolved = c.resolved
    assert resolved is not None
    variants = {leaf.store: leaf.variant() for leaf in resolved.store_leaves}
    for name, path in resolved.stores.items():
        _fresh_dir(path)
        src = prepared.get((name, variants.get(name, "")))
        if src and os.path.isdir(src):
            shutil.copytree(src, path)
        else:
            os.makedirs(path, exist_ok=True)
    prog = run.progress
    describe = f"{c.label} ({run.where(seed, round_no)})"
    task = prog.add_task(describe, total=len(wl.requests))

    def on_progress(msg: dict[str, Any]) -> None:
        if msg.get("phase") == "replay":
            prog.update(task, completed=msg.get("done", 0), description=describe)
        else:
            prog.update(task, description=f"{describe} ({msg.get('phase')})")

    run_dir = run.out / "runs" / c.label / f"seed{seed}" / f"round{round_no + 1}"
    log = run_dir / "engine.log"
    t0 = time.perf_counter()
    try:
        prog.update(task, description=f"{describe} (start)")
        with _engine(
            run.opts,
            run.model_dir,
            resolved.kv_transfer_config,
            seed,
            run_dir,
            c.label,
            on_progress,
            graceful=False,
        ) as proc:
            started = time.perf_counter() - t0
            res: RunResult = proc.call(
                "kvcompose.bench.replay:measure",
                label=c.label,
                seed=seed,
                round_no=round_no,
                requests=[r.to_dict() for r in wl.requests],
                warmup=warm,
                stores=resolved.stores,
                timeout_s=run.opts.contender_timeout_s,
            )
        res.engine_start_s = round_s(started)
    except (EngineError, TimeoutError) as exc:
        error, tail = _failure(exc, log)
        res = RunResult(label=c.label, seed=seed, round=round_no, error=error, log_tail=tail)
    finally:
        if not run.opts.keep_stores:
            for path in resolved.stores.values():
                shutil.rmtree(path, ignore_errors=True)
    res.total_s = round_s(time.perf_counter() - t0)
    res.log = str(log)
    (run_dir / "result.json").write_text(res.model_dump_json(indent=1))
    prog.remove_task(task)
    run.note(_run_line(res, f"{c.label}, {run.where(seed, round_no)}"))
    return res


def _run_line(res: RunResult, what: str) -> str:
    if not res.ok:
        return f"{what}: failed after {res.total_s:.0f} s ({res.error})"
    from kvcompose.bench.metrics import percentile, request_latencies

    ttft = [request_latencies(r)[0] for r in res.requests]
    done = sum(1 for r in res.requests if r.finish_s is not None)
    p50 = percentile(ttft, 50)
    return (
        f"{what}: {done}/{len(res.requests)} requests, TTFT p50 "
        f"{'-' if p50 is None else f'{p50 * 1000:,.0f} ms'}, {res.total_s:.0f} s"
    )
