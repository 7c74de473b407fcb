"""Scheduler-side overhead of composing connectors, on vLLM's real scheduler (no model).

For each number of concurrent requests N and children k, the same workload runs through
``kvcompose.testing.harness.SchedulerHarness`` (vLLM's own ``Scheduler``, ``KVOutputAggregator``
and ``update_from_output``; only the forward pass is absent) with:

- ``none``: no connector (the baseline);
- ``direct``: one ``NoopConnector`` called directly by the scheduler;
- ``multiconnector-k``: vLLM's ``MultiConnector`` over k no-op children;
- ``kvcompose-k``: a kvcompose ``chain`` (policy ``first``) over k no-op children.

All N requests arrive at once: one admission step looks up and allocates every request
(``get_num_new_matched_tokens``, ``update_state_after_alloc`` on every child), then decode
steps (``build_connector_meta``, ``update_connector_output`` each step), and the last step
finishes every request (``request_finished`` on every child). Times are wall-clock around
``add_request`` and ``SchedulerHarness.step`` with the garbage collector paused; each
configuration runs ``repeats`` times, interleaved, and the best run is kept (interference from
other processes only adds time).

Two measures: ``in_connector``, the wall time spent inside the scheduler's calls into its
connector (every public method of the root connector is wrapped with a timer; the wrapper
costs the same for every configuration), and ``added``, the whole step time minus ``none``'s
(what the scheduler loses in all, noisier). Both are per request and engine step; ratios
compare configurations measured in the same run.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.bench.noop import MODULE_PATH, noop_config


@dataclass
class OverheadOptions:
    requests: list[int] = field(default_factory=lambda: [1000, 4000])
    children: list[int] = field(default_factory=lambda: [2, 4])
    steps: int = 12  # decode steps (the run has steps + 2 engine steps in all)
    repeats: int = 3
    prompt_len: int = 32
    block_size: int = 16
    model_dir: str | None = None  # default: the tiny test model (only its config is read)


def configurations(children: list[int]) -> dict[str, dict[str, Any] | None]:
    from kvcompose.testing.trees import chain, kvcompose_config

    out: dict[str, dict[str, Any] | None] = {"none": None, "direct": noop_config()}
    for k in children:
        out[f"multiconnector-{k}"] = {
            "kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [noop_config() for _ in range(k)]}}
        leaves = [{"kind": "leaf", "name": f"c{i}", "connector": "NoopConnector",
                   "module_path": MODULE_PATH} for i in range(k)]
        out[f"kvcompose-{k}"] = kvcompose_config(chain("tiers", *leaves, policy="first"))
    return out


def _one_run(model_dir: Path, ktc: dict[str, Any] | None, n: int, opts: OverheadOptions
             ) -> dict[str, float]:
    from kvcompose.testing.harness import SchedulerHarness

    max_tokens = opts.steps + 2
    per_req_blocks = -(-(opts.prompt_len + max_tokens) // opts.block_size) + 1
    h = SchedulerHarness(model_dir, ktc, block_size=opts.block_size,
                         num_blocks=n * per_req_blocks + 64, max_num_seqs=n,
                         max_num_batched_tokens=n * opts.prompt_len,
                         max_model_len=opts.prompt_len + max_tokens + opts.block_size)
    timer = _CallTimer(h.scheduler.connector) if h.scheduler.connector is not None else None
    try:
        prompts = [h.make_prompt(opts.prompt_len, seed=i) for i in range(n)]
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            for i, p in enumerate(prompts):
                h.add_request(p, max_tokens=max_tokens, request_id=f"r{i}")
            add_s = time.perf_counter() - t
            steps: list[float] = []
            finish_step = None
            admitted = 0
            finished = 0
            while h.has_work():
                t = time.perf_counter()
                res = h.step()
                steps.append(time.perf_counter() - t)
                if len(steps) == 1:
                    admitted = len(res.scheduled)
                finished += len(res.finished)
                if res.finished and finish_step is None:
                    finish_step = len(steps) - 1
                if len(steps) > max_tokens + 5:
                    raise RuntimeError("overhead run did not finish")
        finally:
            gc.enable()
        if admitted != n:
            raise RuntimeError(f"only {admitted} of {n} requests admitted in the first step")
        if finished != n or finish_step is None:
            raise RuntimeError(f"{finished} of {n} requests finished")
        return {"add_s": add_s, "admit_s": steps[0],
                "decode_s": statistics.fmean(steps[1:finish_step]),
                "finish_s": sum(steps[finish_step:]),
                "total_s": add_s + sum(steps), "steps": float(len(steps)),
                "in_connector_s": timer.total if timer else 0.0,
                "connector_calls": float(timer.calls if timer else 0),
                **{f"method.{k}": v[0] for k, v in (timer.by_method if timer else {}).items()
                   if v[1]}}
    finally:
        h.close()


class _CallTimer:
    """Times every call the scheduler makes into its (root) connector.

    Each public method of the connector instance is replaced by a wrapper that adds the
    call's wall time to ``total``. The scheduler makes the same calls whatever the connector
    is, so the wrapper's own cost (a fraction of a microsecond per call) is the same for
    every configuration; children inside a composite are not wrapped.
    """

    def __init__(self, connector: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        self.total = 0.0
        self.calls = 0
        self.by_method: dict[str, list[float]] = {}  # name -> [seconds, calls]
        names = {n for n in dir(KVConnectorBase_V1) if not n.startswith("_")}
        for name in sorted(names):
            if isinstance(getattr(type(connector), name, None), property):
                continue
            method = getattr(connector, name, None)
            if callable(method) and not isinstance(method, type):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        perf = time.perf_counter
        entry = self.by_method.setdefault(name, [0.0, 0])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = perf()
            try:
                return method(*args, **kwargs)
            finally:
                dt = perf() - t
                self.total += dt
                self.calls += 1
                entry[0] += dt
                entry[1] += 1

        return timed


def run_overhead(opts: OverheadOptions, progress: Any = None) -> dict[str, Any]:
    """Measure every configuration for every N; return a JSON-able result with ratios."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if opts.model_dir:
        model_dir = Path(opts.model_dir)
    else:
        from kvcompose.bench.model import tiny_model

        model_dir = tiny_model()
    configs = configurations(opts.children)
    t0 = time.perf_counter()
    raw: dict[int, dict[str, list[dict[str, float]]]] = {}
    for n in opts.requests:
        raw[n] = {name: [] for name in configs}
        _one_run(model_dir, None, min(n, 64), opts)  # warm imports and caches
        for rep in range(opts.repeats):
            for name, ktc in configs.items():
                raw[n][name].append(_one_run(model_dir, ktc, n, opts))
                if progress is not None:
                    progress.print(f"overhead: N={n} repeat {rep + 1}/{opts.repeats} {name}: "
                                   f"{raw[n][name][-1]['total_s'] * 1000:.1f} ms")
    results: dict[str, Any] = {
        "meta": {"options": asdict(opts), "model": str(model_dir), "vllm": _version("vllm"),
                 "python": platform.python_version(), "cpus": os.cpu_count(),
                 "duration_s": None},
        "by_requests": {},
    }
    for n, per_config in raw.items():
        # Best of the repeats: interference from other processes only ever adds time.
        best = {name: {k: min(r.get(k, 0.0) for r in runs) for k in runs[0]}
                for name, runs in per_config.items()}
        base = best["none"]
        steps = base["steps"]
        rows: dict[str, Any] = {}
        for name, m in best.items():
            rows[name] = {
                "in_connector_us_per_request_step": round(m["in_connector_s"] / (n * steps)
                                                          * 1e6, 4),
                "connector_calls": int(m["connector_calls"]),
                "total_ms": round(m["total_s"] * 1e3, 3),
                "us_per_request_step": round(m["total_s"] / (n * steps) * 1e6, 4),
                "added_us_per_request_step": round((m["total_s"] - base["total_s"])
                                                   / (n * steps) * 1e6, 4),
                "added_us_per_request_admit": round((m["admit_s"] + m["add_s"] - base["admit_s"]
                                                     - base["add_s"]) / n * 1e6, 4),
                "added_us_per_request_decode_step": round((m["decode_s"] - base["decode_s"])
                                                          / n * 1e6, 4),
                "added_us_per_request_finish": round((m["finish_s"] - base["finish_s"]) / n
                                                     * 1e6, 4),
                "runs_total_ms": [round(r["total_s"] * 1e3, 3) for r in per_config[name]],
                "runs_in_connector_ms": [round(r["in_connector_s"] * 1e3, 3)
                                         for r in per_config[name]],
                "in_connector_us_per_request_by_method": {
                    k.split(".", 1)[1]: round(v / n * 1e6, 4) for k, v in m.items()
                    if k.startswith("method.")},
            }
        ratios: dict[str, Any] = {}
        key = "in_connector_us_per_request_step"
        direct = rows["direct"][key]
        for k in opts.children:
            kv = rows[f"kvcompose-{k}"][key]
            mc = rows[f"multiconnector-{k}"][key]
            kv_e2e = rows[f"kvcompose-{k}"]["added_us_per_request_step"]
            mc_e2e = rows[f"multiconnector-{k}"]["added_us_per_request_step"]
            ratios[f"{k}_children"] = {
                "kvcompose_over_multiconnector": _ratio(kv, mc),
                "kvcompose_over_direct": _ratio(kv, direct),
                "multiconnector_over_direct": _ratio(mc, direct),
                "kvcompose_no_slower_than_multiconnector": kv <= mc,
                "end_to_end_kvcompose_over_multiconnector": _ratio(kv_e2e, mc_e2e),
            }
        results["by_requests"][str(n)] = {"steps": int(steps), "configs": rows,
                                          "ratios": ratios}
    results["meta"]["duration_s"] = round(time.perf_counter() - t0, 1)
    return results


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, f"{dist}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="scheduler-side overhead on vLLM's real scheduler, no-op children (best of "
                    "repeats; µs per request per engine step)", title_justify="left")
    for col in ("N", "config", "in connector µs", "step total µs", "added vs none µs",
                "admit +µs/req", "decode +µs", "finish +µs/req"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for n, entry in result["by_requests"].items():
        for name, row in entry["configs"].items():
            t.add_row(n, name, f"{row['in_connector_us_per_request_step']:.3f}",
                      f"{row['us_per_request_step']:.2f}",
                      f"{row['added_us_per_request_step']:.2f}",
                      f"{row['added_us_per_request_admit']:.2f}",
                      f"{row['added_us_per_request_decode_step']:.2f}",
                      f"{row['added_us_per_request_finish']:.2f}")
        for k, r in entry["ratios"].items():
            t.add_row(n, f"ratio, {k.replace('_', ' ')}",
                      f"kvc/MC {r['kvcompose_over_multiconnector']}",
                      f"kvc/direct {r['kvcompose_over_direct']}",
                      f"MC/direct {r['multiconnector_over_direct']}", "", "", "")
    return t
