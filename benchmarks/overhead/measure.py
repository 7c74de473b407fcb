"""Scheduler-side overhead of composing connectors, on vLLM's real scheduler (no model).

For each number of concurrent requests N and children k, the same workload runs through
``kvcompose.engine.harness.SchedulerHarness`` (vLLM's own ``Scheduler``, ``KVOutputAggregator``
and ``update_from_output``; only the forward pass is absent) with:

- ``none``: no connector (the baseline);
- ``direct``: one ``NoopConnector`` (``kvcompose.testing.noop``) called directly by the
  scheduler;
- ``multiconnector-k``: vLLM's ``MultiConnector`` over k no-op children;
- ``kvcompose-k``: a kvcompose ``chain`` (policy ``first``) over k no-op children;
- ``floor-k``: ``FloorConnector`` (``overhead.floor``), a bare forwarding composite of k
  no-op children (each child asked and told everything, nothing kept or checked): what
  forwarding to k children costs, so ``kvcompose-k / floor-k`` is about kvcompose's own share;
- ``longest-k`` and ``fastest-k``: a kvcompose chain (policy ``longest``, ``fastest``) over k
  no-op children that hit (``hit_tokens``), child i the prompt less i + 1 blocks, so a lookup
  has k hits to choose between (a prompt seen before in the round hits vLLM's own prefix cache
  instead) (``fastest_over_longest`` is issue 27's overhead goal).
  The children are ``load_range: native``, so ``fastest`` has stitches of them to weigh too
  (every stitch costs, in exact arithmetic, what child 0's one segment costs, so its search
  stops at that segment: ``kvcompose.composite.policies.fastest.search``), and they have an
  ``expect_read`` prior (``HIT_PRIOR``): a child with none is cold and takes one load at a time
  until a load is timed (``Costs.usable``), which never happens here (no worker), so without it
  every request but one would skip the plan choice. Both policies pick child 0's hit, so both
  configurations load the same tokens and differ only in the choosing.

All N requests arrive at once: one admission step looks up and allocates every request
(``get_num_new_matched_tokens``, ``update_state_after_alloc`` on every child), then decode
steps (``build_connector_meta``, ``update_connector_output`` each step), and the last step
finishes every request (``request_finished`` on every child). Times are wall-clock around
``add_request`` and ``SchedulerHarness.step`` with the garbage collector paused; each
round runs every configuration over the same N requests, interleaved engine step by engine step
(the order rotating), so that interference from other processes falls on all of them alike;
there are ``repeats`` rounds. Times per configuration are the best round (interference only
adds time); ratios are the median over rounds of ratios taken within a round.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcompose.bench.flags import opt
from kvcompose.bench.results import package_version
from overhead.results import (
    OverheadEntry,
    OverheadMeta,
    OverheadRatios,
    OverheadResult,
    OverheadRow,
)


@dataclass
class OverheadOptions:
    requests: list[int] = opt(  # noqa: RUF009 (opt makes a dataclass field)
        factory=lambda: [1000, 4000],
        help="concurrent requests (comma-separated; default 1000,4000)",
        minimum=1,
    )
    children: list[int] = opt(  # noqa: RUF009 (opt makes a dataclass field)
        factory=lambda: [2, 4], help="no-op children per composite (default 2,4)", minimum=1
    )
    steps: int = opt(
        12,
        "measured decode steps per configuration and repeat (the run has "
        "steps + 2 engine steps in all)",
        minimum=1,
    )
    repeats: int = opt(
        5, "rounds (each runs every configuration, interleaved; default 5)", minimum=1
    )
    prompt_len: int = opt(
        96,
        "tokens per prompt (more than max(children) blocks: longest-k/fastest-k's children "
        "hold the prompt less 1..k blocks)",
        minimum=1,
    )
    block_size: int = opt(16, "KV cache block size", minimum=1)
    model_dir: str | None = None  # default: the tiny test model (only its config is read)


#: ``fastest-k``'s children's ``expect_read``: a load costs next to nothing, so loading wins
#: every plan choice and every request goes through it (see the module docstring).
HIT_PRIOR = {"latency_ms": 0, "gbps": 1000}


def hit_tokens(child: int, prompt_len: int, block_size: int) -> int:
    """What child ``child`` of ``longest-k``/``fastest-k`` holds: the prompt less
    ``child + 1`` blocks."""
    return prompt_len - (child + 1) * block_size


def configurations(
    children: list[int], prompt_len: int = 96, block_size: int = 16
) -> dict[str, dict[str, Any] | None]:
    from kvcompose.config import load_config
    from kvcompose.config.render import vllm_args
    from kvcompose.testing.noop import MODULE_PATH, noop_config  # imports vLLM
    from overhead.floor import floor_config

    def chain(policy: str, leaves: list[dict[str, Any]]) -> dict[str, Any]:
        document = {
            "version": 1,
            "kv_role": "kv_both",
            "tree": {"chain": {"name": "tiers", "policy": policy, "children": leaves}},
        }
        return vllm_args(load_config(document, env={}))

    out: dict[str, dict[str, Any] | None] = {"none": None, "direct": noop_config()}
    for k in children:
        if hit_tokens(k - 1, prompt_len, block_size) < block_size:
            raise ValueError(
                f"prompt_len {prompt_len} leaves child {k - 1} of {k} no block to hit: "
                f"give more than {k} blocks of {block_size}"
            )
        out[f"multiconnector-{k}"] = {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [noop_config() for _ in range(k)]},
        }
        noop = {"connector": "NoopConnector", "module_path": MODULE_PATH}
        out[f"kvcompose-{k}"] = chain(
            "first", [{"leaf": {"name": f"c{i}", **noop}} for i in range(k)]
        )
        out[f"floor-{k}"] = floor_config(k)
        hits = [
            {
                "name": f"c{i}",
                **noop,
                "extra_config": {"hit_tokens": hit_tokens(i, prompt_len, block_size)},
                "load_range": "native",
            }
            for i in range(k)
        ]
        out[f"longest-{k}"] = chain("longest", [{"leaf": leaf} for leaf in hits])
        out[f"fastest-{k}"] = chain(
            "fastest", [{"leaf": {**leaf, "expect_read": HIT_PRIOR}} for leaf in hits]
        )
    return out


def _make_harness(
    model_dir: Path, ktc: dict[str, Any] | None, n: int, opts: OverheadOptions
) -> Any:
    from kvcompose.engine.harness import SchedulerHarness

    max_tokens = opts.steps + 2
    per_req_blocks = -(-(opts.prompt_len + max_tokens) // opts.block_size) + 1
    return SchedulerHarness(
        model_dir,
        ktc,
        block_size=opts.block_size,
        num_blocks=n * per_req_blocks + 64,
        max_num_seqs=n,
        max_num_batched_tokens=n * opts.prompt_len,
        max_model_len=opts.prompt_len + max_tokens + opts.block_size,
    )


@dataclass
class RoundTimes:
    """One configuration in one round: seconds (``decode_s`` per decode step)."""

    add_s: float
    admit_s: float
    decode_s: float
    finish_s: float
    total_s: float
    steps: int
    admit_tokens: int  # tokens the admission step scheduled (less the connectors' hits)
    in_connector_s: float
    connector_calls: int
    by_method: dict[str, float]  # seconds inside each connector method

    @classmethod
    def best(cls, rounds: list[RoundTimes]) -> RoundTimes:
        """The smallest value of every field over the rounds."""
        methods = {k for r in rounds for k in r.by_method}
        return cls(
            **{
                f: min(getattr(r, f) for r in rounds)
                for f in cls.__dataclass_fields__
                if f != "by_method"
            },
            by_method={k: min(r.by_method.get(k, 0.0) for r in rounds) for k in methods},
        )


def _one_round(
    model_dir: Path, configs: dict[str, dict[str, Any] | None], n: int, opts: OverheadOptions
) -> dict[str, RoundTimes]:
    """Run the same N requests through every configuration, interleaved step by step (each
    engine step of each configuration in turn, the order rotating), so that interference
    from other processes falls on all configurations alike."""
    max_tokens = opts.steps + 2
    names = list(configs)
    harnesses = {name: _make_harness(model_dir, ktc, n, opts) for name, ktc in configs.items()}
    timers = {
        name: (_CallTimer(h.scheduler.connector) if h.scheduler.connector is not None else None)
        for name, h in harnesses.items()
    }
    try:
        prompts = [harnesses[names[0]].make_prompt(opts.prompt_len, seed=i) for i in range(n)]
        add_s: dict[str, float] = {}
        steps: dict[str, list[float]] = {name: [] for name in names}
        admitted: dict[str, int] = {}
        finished = dict.fromkeys(names, 0)
        admit_tokens: dict[str, int] = {}
        finish_step: dict[str, int] = {}
        gc.collect()
        gc.disable()
        try:
            for name in names:
                h = harnesses[name]
                t = time.perf_counter()
                for i, p in enumerate(prompts):
                    h.add_request(p, max_tokens=max_tokens, request_id=f"r{i}")
                add_s[name] = time.perf_counter() - t
            active = list(names)
            rotation = 0
            while active:
                k = rotation % len(active)
                rotation += 1
                for name in active[k:] + active[:k]:
                    h = harnesses[name]
                    if not h.has_work():
                        continue
                    t = time.perf_counter()
                    res = h.step()
                    steps[name].append(time.perf_counter() - t)
                    if len(steps[name]) == 1:
                        admitted[name] = len(res.scheduled)
                        admit_tokens[name] = sum(res.scheduled.values())
                    finished[name] += len(res.finished)
                    if res.finished and name not in finish_step:
                        finish_step[name] = len(steps[name]) - 1
                    if len(steps[name]) > max_tokens + 5:
                        raise RuntimeError(f"overhead run of {name} did not finish")
                active = [name for name in active if harnesses[name].has_work()]
        finally:
            gc.enable()
        out: dict[str, RoundTimes] = {}
        for name in names:
            # every request finished, every block back, no connector state left
            harnesses[name].assert_clean()
            if admitted.get(name) != n:
                raise RuntimeError(
                    f"{name}: only {admitted.get(name)} of {n} requests admitted in the first step"
                )
            if finished[name] != n or name not in finish_step:
                raise RuntimeError(f"{name}: {finished[name]} of {n} requests finished")
            st, fs, timer = steps[name], finish_step[name], timers[name]
            out[name] = RoundTimes(
                add_s=add_s[name],
                admit_s=st[0],
                decode_s=statistics.fmean(st[1:fs]) if fs > 1 else 0.0,
                finish_s=sum(st[fs:]),
                total_s=add_s[name] + sum(st),
                steps=len(st),
                admit_tokens=admit_tokens[name],
                in_connector_s=timer.total if timer else 0.0,
                connector_calls=timer.calls if timer else 0,
                by_method={k: v[0] for k, v in (timer.by_method if timer else {}).items() if v[1]},
            )
        return out
    finally:
        for h in harnesses.values():
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


def run_overhead(opts: OverheadOptions, progress: Any = None) -> OverheadResult:
    """Measure every configuration for every N; return the result with ratios."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if opts.model_dir:
        model_dir = Path(opts.model_dir)
    else:
        from kvcompose.engine.model import tiny_model

        model_dir = tiny_model()
    configs = configurations(opts.children, opts.prompt_len, opts.block_size)
    t0 = time.perf_counter()
    raw: dict[int, dict[str, list[RoundTimes]]] = {}
    for n in opts.requests:
        raw[n] = {name: [] for name in configs}
        _one_round(model_dir, {"none": None, "direct": configs["direct"]}, min(n, 64), opts)
        for rep in range(opts.repeats):
            measured = _one_round(model_dir, configs, n, opts)
            for name, m in measured.items():
                raw[n][name].append(m)
            if progress is not None:
                progress.print(
                    f"overhead: N={n} round {rep + 1}/{opts.repeats}: "
                    + ", ".join(f"{name} {m.total_s * 1000:.0f} ms" for name, m in measured.items())
                )
    result = OverheadResult(
        meta=OverheadMeta(
            options=asdict(opts),
            model=str(model_dir),
            vllm=package_version("vllm"),
            python=platform.python_version(),
            cpus=os.cpu_count(),
        ),
        by_requests={str(n): _summary(n, per_config, opts) for n, per_config in raw.items()},
    )
    result.meta.duration_s = round(time.perf_counter() - t0, 1)
    return result


def _summary(
    n: int, per_config: dict[str, list[RoundTimes]], opts: OverheadOptions
) -> OverheadEntry:
    # Best of the repeats: interference from other processes only ever adds time.
    best = {name: RoundTimes.best(runs) for name, runs in per_config.items()}
    base = best["none"]
    per_step = n * base.steps
    rows: dict[str, OverheadRow] = {}
    for name, m in best.items():
        rows[name] = OverheadRow(
            in_connector_us_per_request_step=round(m.in_connector_s / per_step * 1e6, 4),
            connector_calls=m.connector_calls,
            computed_tokens_per_request=round(m.admit_tokens / n, 2),
            total_ms=round(m.total_s * 1e3, 3),
            us_per_request_step=round(m.total_s / per_step * 1e6, 4),
            added_us_per_request_step=round((m.total_s - base.total_s) / per_step * 1e6, 4),
            added_us_per_request_admit=round(
                (m.admit_s + m.add_s - base.admit_s - base.add_s) / n * 1e6, 4
            ),
            added_us_per_request_decode_step=round((m.decode_s - base.decode_s) / n * 1e6, 4),
            added_us_per_request_finish=round((m.finish_s - base.finish_s) / n * 1e6, 4),
            runs_total_ms=[round(r.total_s * 1e3, 3) for r in per_config[name]],
            runs_in_connector_ms=[round(r.in_connector_s * 1e3, 3) for r in per_config[name]],
            in_connector_us_per_request_by_method={
                k: round(v / n * 1e6, 4) for k, v in m.by_method.items()
            },
        )

    def rounds(a: str, b: str, added: bool = False) -> list[float]:
        """a/b in each round, the two numbers measured side by side (``added``: total time
        over no connector's in the same round)."""
        vals = []
        for ra, rb, rn in zip(per_config[a], per_config[b], per_config["none"], strict=True):
            x, y = (
                (ra.total_s - rn.total_s, rb.total_s - rn.total_s)
                if added
                else (ra.in_connector_s, rb.in_connector_s)
            )
            if y > 0:
                vals.append(round(x / y, 3))
        return vals

    def median(vals: list[float]) -> float | None:
        return round(statistics.median(vals), 3) if vals else None

    ratios: dict[str, OverheadRatios] = {}
    for k in opts.children:
        kvn, mcn, floor = f"kvcompose-{k}", f"multiconnector-{k}", f"floor-{k}"
        kvc_mc, kvc_direct = rounds(kvn, mcn), rounds(kvn, "direct")
        mc_direct = rounds(mcn, "direct")
        kvc_floor, floor_direct = rounds(kvn, floor), rounds(floor, "direct")
        fastest_longest = rounds(f"fastest-{k}", f"longest-{k}")
        ratios[f"{k}_children"] = OverheadRatios(
            kvcompose_over_multiconnector=median(kvc_mc),
            kvcompose_over_direct=median(kvc_direct),
            multiconnector_over_direct=median(mc_direct),
            kvcompose_no_slower_than_multiconnector=(
                rows[kvn].in_connector_us_per_request_step
                <= rows[mcn].in_connector_us_per_request_step
            ),
            end_to_end_added_kvcompose_over_multiconnector=median(rounds(kvn, mcn, added=True)),
            kvcompose_over_multiconnector_rounds=kvc_mc,
            kvcompose_over_direct_rounds=kvc_direct,
            multiconnector_over_direct_rounds=mc_direct,
            kvcompose_over_floor=median(kvc_floor),
            floor_over_direct=median(floor_direct),
            kvcompose_over_floor_rounds=kvc_floor,
            floor_over_direct_rounds=floor_direct,
            fastest_over_longest=median(fastest_longest),
            fastest_over_longest_rounds=fastest_longest,
        )
    return OverheadEntry(steps=base.steps, configs=rows, ratios=ratios)
