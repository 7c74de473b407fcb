"""What runs inside a contender's engine process (``EngineProcess.call``).

- ``measure``: run the warm-up requests, snapshot the counters, replay the workload in its
  order and timing (requests are added when their arrival time has come, between engine
  steps), snapshot again. Per request: arrival, first-token and finish times
  (``time.perf_counter`` around ``LLMEngine.step``), output token ids, cached tokens. Per node
  and store: counter deltas over the replay.
- ``prefill``: fill a store before the comparison: the engine's only connector writes that
  store; its prefill prompts run through it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvcompose.bench.results import KVCacheFacts, RequestRecord, RunResult, StoreUsage
from kvcompose.bench.snapshot import connector_snapshot, flush_store_writers, snapshot_delta
from kvcompose.engine.process import report_progress

# --------------------------------------------------------------------------- replay


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


def replay(
    engine: Any,
    requests: list[dict[str, Any]],
    *,
    phase: str = "replay",
    timed: bool = True,
    timeout_s: float | None = None,
) -> dict[str, RequestRecord]:
    """Feed ``requests`` to ``engine`` (a v1 ``LLMEngine``) at their arrival times and step it
    until all are done. Returns per-request records keyed by request id."""
    from vllm.inputs import TokensPrompt

    pending = deque(sorted(requests, key=lambda r: r["arrival_s"] if timed else 0.0))
    records: dict[str, RequestRecord] = {}
    by_engine_id: dict[str, str] = {}
    total = len(pending)
    done = 0
    start = time.perf_counter()
    last_report = 0.0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        if timeout_s is not None and now > timeout_s:
            raise TimeoutError(
                f"{phase}: still running after {timeout_s:.0f} s ({done}/{total} requests done)"
            )
        while pending and (not timed or pending[0]["arrival_s"] <= now):
            r = pending.popleft()
            engine_id = engine.add_request(
                r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), _sampling(int(r["max_tokens"]))
            )
            by_engine_id[str(engine_id)] = r["id"]
            records[r["id"]] = RequestRecord(
                id=r["id"],
                arrival_s=r["arrival_s"] if timed else 0.0,
                added_s=now,
                prompt_tokens=len(r["prompt"]),
                tags=r.get("tags", {}),
            )
        if engine.has_unfinished_requests():
            outputs = engine.step()
            t = time.perf_counter() - start
            for out in outputs:
                rid = by_engine_id.get(str(out.request_id), str(out.request_id))
                rec = records.get(rid)
                if rec is None:
                    continue
                new = list(out.outputs[0].token_ids) if out.outputs else []
                if new and rec.first_token_s is None:
                    rec.first_token_s = t
                rec.output_token_ids.extend(new)
                cached = getattr(out, "num_cached_tokens", None)
                if cached:
                    rec.num_cached_tokens = max(rec.num_cached_tokens, int(cached))
                if out.finished:
                    rec.finish_s = t
                    done += 1
            if time.perf_counter() - last_report > 0.5 or done == total:
                report_progress(phase=phase, done=done, total=total)
                last_report = time.perf_counter()
        elif pending:
            time.sleep(max(0.0, min(pending[0]["arrival_s"] - now, 0.05)))
    report_progress(phase=phase, done=done, total=total)
    return records


def _usage(store_paths: dict[str, str]) -> dict[str, dict[str, int]]:
    from kvcompose.stores import store_usage

    return {name: store_usage(path) for name, path in store_paths.items()}


def measure(
    llm: Any,
    *,
    label: str,
    seed: int,
    round_no: int,
    requests: list[dict[str, Any]],
    warmup: list[list[int]],
    stores: dict[str, str],
    timeout_s: float | None,
    timed: bool = True,
    warmup_max_tokens: int = 4,
) -> RunResult:
    """Warm up, replay ``requests``, return the timings, the counter deltas, the KV cache vLLM
    set up and the preemptions of the replay."""
    from kvcompose.engine.probe import kv_cache_facts, scheduler_connector

    engine = llm.llm_engine
    result = RunResult(label=label, seed=seed, round=round_no)
    result.kv_cache = KVCacheFacts(**kv_cache_facts(llm))
    t = time.perf_counter()
    warm = [
        {"id": f"warmup-{i}", "prompt": p, "arrival_s": 0.0, "max_tokens": warmup_max_tokens}
        for i, p in enumerate(warmup)
    ]
    if warm:
        replay(engine, warm, phase="warmup", timed=False, timeout_s=timeout_s)
    result.warmup_s = round_s(time.perf_counter() - t)
    flush_store_writers()  # the warm-up's writes stay out of the replay's counts
    before = connector_snapshot(llm, stores)
    usage_before = _usage(stores)
    t = time.perf_counter()
    with watch_scheduler(llm) as watched:
        records = replay(engine, requests, phase="replay", timed=timed, timeout_s=timeout_s)
    result.preemptions, result.peak_running = watched.preemptions, watched.peak_running
    result.replay_s = round_s(time.perf_counter() - t)
    flush_store_writers()  # after the timed replay: the writes it queued, counted
    after = connector_snapshot(llm, stores)
    usage_after = _usage(stores)
    result.connector = snapshot_delta(after, before)
    result.store_usage = {
        name: StoreUsage(before=usage_before[name], after=usage_after[name]) for name in stores
    }
    live = getattr(scheduler_connector(llm), "live_requests", None)
    result.live_requests_after = live() if callable(live) else {}
    result.requests = [records[r["id"]] for r in requests]
    result.ok = True
    return result


@dataclass
class SchedulerWatch:
    """What the scheduler did during a replay: requests preempted, and the most requests
    running at once."""

    preemptions: int = 0
    peak_running: int = 0


@contextlib.contextmanager
def watch_scheduler(llm: Any) -> Iterator[SchedulerWatch]:
    """Counts the requests the scheduler preempts inside the block, and the most it runs at
    once: vLLM's ``Scheduler.schedule`` preempts a running request through
    ``_preempt_request`` when a step's blocks do not fit (the count vLLM logs as
    ``vllm:num_preemptions``), and keeps the requests it runs in ``running``."""
    from kvcompose.engine.probe import scheduler

    sched = scheduler(llm)
    preempt, schedule = sched._preempt_request, sched.schedule
    watch = SchedulerWatch()

    def counting(*args: Any, **kwargs: Any) -> Any:
        watch.preemptions += 1
        return preempt(*args, **kwargs)

    def scheduling(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        watch.peak_running = max(watch.peak_running, len(sched.running))
        return out

    sched._preempt_request, sched.schedule = counting, scheduling
    try:
        yield watch
    finally:
        sched._preempt_request, sched.schedule = preempt, schedule


def prefill(llm: Any, prompts: list[list[int]]) -> None:
    """Run ``prompts`` through the engine, a few at a time: its store saves what each step
    computed."""
    from kvcompose.engine.llm import greedy

    for k in range(0, len(prompts), 8):
        greedy(llm, prompts[k : k + 8], 1)


def round_s(seconds: float) -> float:
    return round(seconds, 3)
