"""``run_bench``: one workload against several contenders, each in a fresh engine with fresh
stores.

Steps:

1. build the model (``builtin``: see ``kvcompose.engine.model``) and the workload per seed;
2. resolve every contender (store placeholders → per-contender directories); a contender that
   cannot be resolved is reported as failed and the others still run;
3. prepare each store the workload fills (``fast``, ``disk``...) once per seed, in an engine
   whose only connector is that store's leaf;
4. for each seed, in rounds (``repeats``; the contenders' order rotates from round to round,
   so that a slow spell of a shared machine does not land on one contender), for each
   contender: copy the prepared stores into the contender's fresh directories, start an
   engine in its own process (``kvcompose.engine.process``), warm it up, replay the workload
   (``kvcompose.bench.replay``), read back per-request timings and per-node/per-store counter
   deltas;
5. summarise (``kvcompose.bench.summary``: TTFT ratios to recompute taken within each round,
   their median and range, which contenders are within noise of each other), write
   ``results.json``, ``results.csv``, ``requests.csv`` and the plots
   (``kvcompose.bench.report``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from kvcompose.bench import contenders as cmod
from kvcompose.bench import report
from kvcompose.bench.jobs import Session, default_tmpfs_root, prepare_stores, run_contender
from kvcompose.bench.options import BenchOptions
from kvcompose.bench.resolve import resolve
from kvcompose.bench.results import (
    BenchResults,
    Meta,
    package_version,
)
from kvcompose.bench.summary import Contender, summarise
from kvcompose.bench.traces import load_trace, write_trace
from kvcompose.bench.workloads import (
    BUILTIN,
    Workload,
    WorkloadError,
    chat_workload,
    docqa_workload,
    noreuse_workload,
    token_block,
)
from kvcompose.engine.model import model_facts, resolve_model

T = TypeVar("T")


class BenchError(RuntimeError):
    """The comparison cannot run at all (bad workload, no model...)."""


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
        if not os.path.isfile(path):  # a FIFO or a device would block or never end
            why = "not a regular file" if os.path.exists(path) else "no such file"
            raise WorkloadError(f"workload {spec!r}: not one of {', '.join(BUILTIN)} and {why}")
        wl = load_trace(
            path,
            vocab_size=vocab_size,
            seed=seed,
            limit=opts.trace_limit,
            max_tokens=opts.max_tokens,
            mooncake=opts.mooncake,
        )
    if opts.max_tokens is not None:
        for r in wl.requests:
            r.max_tokens = opts.max_tokens
    if opts.time_scale != 1.0:
        wl = wl.scaled(opts.time_scale)
    if not opts.prefill:
        wl.prefill = {}
    too_long = [
        r.id for r in wl.requests if len(r.prompt) + r.max_tokens > opts.engine.max_model_len
    ]
    if too_long:
        raise WorkloadError(
            f"{len(too_long)} requests (e.g. {too_long[0]}) do not fit "
            f"max_model_len {opts.engine.max_model_len}; raise "
            "--max-model-len or shorten the workload"
        )
    if not wl.requests:
        raise WorkloadError("the workload has no requests")
    return wl


def warmup_length(prompt_lengths: list[int]) -> int:
    """The warm-up prompts' length: a typical one of the workload's (the upper median)."""
    return statistics.median_high(prompt_lengths) if prompt_lengths else 256


def warmup_prompts(wl: Workload, n: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts unrelated to the workload (they share nothing with it), typical length."""
    length = warmup_length([len(r.prompt) for r in wl.requests])
    return [
        token_block(f"warmup{i}", length, vocab_size=vocab_size, seed=seed + 7919) for i in range(n)
    ]


# --------------------------------------------------------------------------- the run


def run_bench(opts: BenchOptions, console: Any = None) -> BenchResults:
    """Run the comparison; write everything under ``opts.out_dir``; return the results."""
    t_start = time.perf_counter()
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    if opts.repeats < 1:
        raise BenchError(f"--repeats must be at least 1, got {opts.repeats}")
    out = _writable_dir(opts.out_dir, "--out")
    store_root = (
        _writable_dir(opts.store_root, "--store-dir") if opts.store_root else out / "stores"
    )
    tmpfs_base = (
        _writable_dir(opts.tmpfs_root, "--tmpfs-dir") if opts.tmpfs_root else default_tmpfs_root()
    )
    try:
        model_dir = resolve_model(opts.model)
        facts = model_facts(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise BenchError(str(exc)) from None
    vocab = facts["vocab_size"]

    workloads: dict[int, Workload] = {}
    for seed in opts.seeds:
        try:
            workloads[seed] = build_workload(opts, vocab, seed)
        except WorkloadError as exc:
            raise BenchError(str(exc)) from None
    contenders, problems = _contenders(opts, out)
    tmp_owned = None
    if tmpfs_base:
        Path(tmpfs_base).mkdir(parents=True, exist_ok=True)
        tmp_owned = tempfile.mkdtemp(prefix="kvcompose-bench-", dir=tmpfs_base)
        tmpfs_root = tmp_owned
    else:
        tmpfs_root = str(store_root / "tmpfs")
    for c in contenders:
        try:
            c.resolved = resolve(
                c.definition,
                out / "runs" / c.label,
                disk_root=store_root / "contenders",
                tmpfs_root=tmpfs_root,
            )
        except cmod.ContenderError as exc:
            problems.append(str(exc))
        except Exception as exc:  # its run directory, its text with the store paths in
            problems.append(f"contender {c.label!r}: {type(exc).__name__}: {exc}")
    if problems:  # before any engine: a typo should not cost a whole run
        _cleanup(tmp_owned, store_root, keep=opts.keep_stores)
        raise BenchError("\n".join(problems))

    first = workloads[opts.seeds[0]]
    write_trace(first, out / "workload.jsonl")
    results = BenchResults(
        meta=Meta(
            started=started,
            kvcompose=package_version("kvcompose"),
            vllm=package_version("vllm"),
            torch=package_version("torch"),
            python=platform.python_version(),
            machine={"cpus": os.cpu_count(), "platform": platform.platform()},
            model={"spec": opts.model, "path": str(model_dir), **facts},
            engine=opts.engine.to_dict(),
            seeds=opts.seeds,
            workload=first.summary(),
            workload_description=first.description,
            time_scale=opts.time_scale,
            warmup_requests=opts.warmup_requests,
            repeats=opts.repeats,
            out_dir=str(out),
        )
    )

    con = console if console is not None else Console(emoji=False)
    previous = _exit_on_sigterm()
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=con,
            disable=not (opts.progress and con.is_terminal),  # bars only on a terminal
        ) as prog:
            session = Session(opts, model_dir, out, store_root, prog)
            rounds = opts.repeats
            total = len(opts.seeds) * (1 + rounds * len(contenders))
            overall = prog.add_task("kvcompose bench", total=total)
            session.note(
                f"kvcompose bench: {len(contenders)} contenders x {rounds} rounds x "
                f"{len(opts.seeds)} seeds, {first.name} workload of {len(first.requests)} "
                f"requests; engine logs under {out / 'runs'}"
            )
            for seed in opts.seeds:
                wl = workloads[seed]
                prepared = prepare_stores(session, contenders, wl, seed, results)
                prog.advance(overall)
                warm = warmup_prompts(wl, opts.warmup_requests, vocab, seed)
                for rnd in range(rounds):
                    for c in round_order(contenders, rnd):
                        res = run_contender(session, c, wl, warm, seed, rnd, prepared)
                        c.runs.append(res)
                        prog.advance(overall)
                        if not res.ok:
                            session.log(
                                f"[red]contender {escape(repr(c.label))} failed:[/red] "
                                f"{escape(res.error or '')} (log: {escape(str(res.log))})"
                            )
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _cleanup(tmp_owned, store_root, keep=opts.keep_stores)

    results.contenders = summarise(contenders, several_runs=len(opts.seeds) * opts.repeats > 1)
    results.meta.duration_s = round(time.perf_counter() - t_start, 1)
    report.write_all(results, out, plots=opts.plots)
    return results


def _writable_dir(path: str, flag: str) -> Path:
    """``path`` made if needed and written to once, or a ``BenchError`` naming ``flag``:
    before anything runs, not after the first contender."""
    where = Path(path).resolve()
    try:
        where.mkdir(parents=True, exist_ok=True)
        (where / ".kvcompose-write-check").touch()
        (where / ".kvcompose-write-check").unlink()
    except OSError as exc:
        why = "not a directory" if where.exists() and not where.is_dir() else exc.strerror or exc
        raise BenchError(f"{flag} {path}: {why}") from None
    return where


def _cleanup(tmp_owned: str | None, store_root: Path, *, keep: bool) -> None:
    """Remove the run's stores (unless ``--keep-stores``)."""
    if keep:
        return
    if tmp_owned:
        shutil.rmtree(tmp_owned, ignore_errors=True)
    shutil.rmtree(store_root / "contenders", ignore_errors=True)
    shutil.rmtree(store_root / "prepared", ignore_errors=True)
    with contextlib.suppress(OSError):
        store_root.rmdir()


def round_order(items: list[T], rnd: int) -> list[T]:
    """The order of round ``rnd``: rotated by one per round (A B C, B C A, C A B...)."""
    k = rnd % len(items) if items else 0
    return items[k:] + items[:k]


def _contenders(opts: BenchOptions, out: Path) -> tuple[list[Contender], list[str]]:
    """The contenders given (or the built-in ones), and why those that cannot be read fail."""
    specs = list(opts.contenders) or list(cmod.DEFAULT_CONTENDERS)
    found: list[Contender] = []
    problems: list[str] = []
    for arg in specs:
        try:
            found.append(Contender(definition=cmod.parse_contender(arg)))
        except cmod.ContenderError as exc:
            problems.append(str(exc))
    cmod.unique_labels([c.definition for c in found])
    if not opts.contenders:
        cmod.write_builtin_contenders(out / "contenders")
    return found, problems


def _exit_on_sigterm() -> Any:
    """Turn SIGTERM into ``SystemExit`` (main thread only), so that stores and the running
    engine are cleaned up; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)
