"""One engine of ``kvcompose bench``, in its own process: ``python -m kvcompose.bench.runner JOB``.

The parent writes a job file (JSON) and reads back a result file; progress goes to stdout as
lines starting with ``@@bench `` (everything else on stdout/stderr is the engine's log).

Modes:

- ``prefill``: fill stores before the comparison. For each store, start a single-process
  engine whose only connector writes that store, and run its prefill prompts through it.
- ``measure``: start a single-process engine with the chain's connector, run the warm-up
  requests, snapshot the counters, replay the workload in its order and timing (requests are
  added when their arrival time has come, between engine steps), snapshot again. Per request:
  arrival, first-token and finish times (``time.perf_counter`` around ``LLMEngine.step``),
  output token ids, cached tokens. Per node and store: counter deltas over the replay.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

PROGRESS_PREFIX = "@@bench "


def progress(**fields: Any) -> None:
    sys.stdout.write(PROGRESS_PREFIX + json.dumps(fields) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- replay


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def replay(engine: Any, requests: list[dict[str, Any]], *, phase: str = "replay",
           timed: bool = True, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Feed ``requests`` to ``engine`` (a v1 ``LLMEngine``) at their arrival times and step it
    until all are done. Returns per-request records keyed by request id."""
    from vllm.inputs import TokensPrompt

    pending = deque(sorted(requests, key=lambda r: (r["arrival_s"] if timed else 0.0)))
    records: dict[str, dict[str, Any]] = {}
    by_engine_id: dict[str, str] = {}
    total = len(pending)
    done = 0
    start = time.perf_counter()
    last_report = 0.0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        if timeout_s is not None and now > timeout_s:
            raise TimeoutError(f"{phase}: still running after {timeout_s:.0f} s "
                               f"({done}/{total} requests done)")
        while pending and (not timed or pending[0]["arrival_s"] <= now):
            r = pending.popleft()
            engine_id = engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                                           _sampling(int(r["max_tokens"])))
            by_engine_id[str(engine_id)] = r["id"]
            records[r["id"]] = {
                "id": r["id"], "arrival_s": r["arrival_s"] if timed else 0.0,
                "added_s": now, "first_token_s": None, "finish_s": None,
                "prompt_tokens": len(r["prompt"]), "output_token_ids": [],
                "num_cached_tokens": 0, "tags": r.get("tags", {}),
            }
        if engine.has_unfinished_requests():
            outputs = engine.step()
            t = time.perf_counter() - start
            for out in outputs:
                rid = by_engine_id.get(str(out.request_id), str(out.request_id))
                rec = records.get(rid)
                if rec is None:
                    continue
                new = list(out.outputs[0].token_ids) if out.outputs else []
                if new and rec["first_token_s"] is None:
                    rec["first_token_s"] = t
                rec["output_token_ids"].extend(new)
                cached = getattr(out, "num_cached_tokens", None)
                if cached:
                    rec["num_cached_tokens"] = max(rec["num_cached_tokens"], int(cached))
                if out.finished:
                    rec["finish_s"] = t
                    done += 1
            if time.perf_counter() - last_report > 0.5 or done == total:
                progress(phase=phase, done=done, total=total)
                last_report = time.perf_counter()
        elif pending:
            time.sleep(max(0.0, min(pending[0]["arrival_s"] - now, 0.05)))
    progress(phase=phase, done=done, total=total)
    return records


# --------------------------------------------------------------------------- stats


def _counters(node: Any) -> dict[str, int]:
    counters = getattr(node, "counters", None)
    totals = getattr(counters, "totals", None)
    if totals is not None:
        return dict(totals)
    return dict(counters or {})


def connector_snapshot(llm: Any, store_paths: dict[str, str]) -> dict[str, Any]:
    """Cumulative counters of the engine's connectors, by node name.

    Scheduler side: every kvcompose composite node's counters (lookups, ``hits.<child>``,
    ``hit_tokens.<child>``, guard counters). Worker side: every PrefixStoreConnector's
    ``total_stats`` (tokens/chunks/bytes loaded and saved). vLLM's MultiConnector keeps no
    lookup counters; its children are named after their stores.
    """
    from kvcompose.composite import CompositeConnector

    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        sched = None
    worker = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = get_kv_transfer_group()
    except Exception:
        worker = None
    by_path = {os.path.realpath(p): n for n, p in store_paths.items()}
    nodes: dict[str, Any] = {}
    stores: dict[str, Any] = {}

    def leaf_name(conn: Any, fallback: str) -> str:
        cfg = getattr(conn, "config", None)
        path = getattr(cfg, "path", None)
        if isinstance(path, str):
            return by_path.get(os.path.realpath(path), fallback)
        return fallback

    def visit(s: Any, w: Any, name: str, parent: str | None) -> None:
        obj = s if s is not None else w
        if obj is None:
            return
        cls = type(obj)
        entry: dict[str, Any] = {"class": f"{cls.__module__}:{cls.__qualname__}",
                                 "parent": parent}
        if isinstance(obj, CompositeConnector):
            entry["kind"] = "kvcompose"
            entry["policy"] = getattr(obj.spec, "policy", obj.spec.kind)
            entry["counters"] = _counters(s) if s is not None else {}
            entry["children"] = [c.name for c in obj.children]
            nodes[name] = entry
            w_children = list(getattr(w, "children", []) or [])
            for i, child in enumerate(obj.children):
                wc = w_children[i].connector if i < len(w_children) else None
                sc = child.connector if s is not None else None
                visit(sc, wc, child.name, name)
            return
        subs = getattr(obj, "_connectors", None)
        if cls.__name__ == "MultiConnector" and isinstance(subs, list):
            entry["kind"] = "multiconnector"
            entry["counters"] = {}
            s_subs = list(getattr(s, "_connectors", []) or []) if s is not None else []
            w_subs = list(getattr(w, "_connectors", []) or []) if w is not None else []
            names = []
            for i in range(max(len(s_subs), len(w_subs))):
                sc = s_subs[i] if i < len(s_subs) else None
                wc = w_subs[i] if i < len(w_subs) else None
                cname = leaf_name(sc or wc, f"{i}-{type(sc or wc).__name__}")
                names.append(cname)
                visit(sc, wc, cname, name)
            entry["children"] = names
            nodes[name] = entry
            return
        entry["kind"] = "leaf"
        store = leaf_name(obj, name)
        entry["store"] = store if store in store_paths else None
        nodes[name] = entry
        total = getattr(w, "total_stats", None) if w is not None else None
        if total is not None and entry["store"] is not None:
            stores[store] = {k: v for k, v in dict(total.data).items()
                             if isinstance(v, int | float)}

    if sched is not None or worker is not None:
        root = sched if sched is not None else worker
        if isinstance(root, CompositeConnector):
            root_name = root.name
        else:
            root_name = leaf_name(root, type(root).__name__)
        visit(sched, worker, root_name, None)
    return {"nodes": nodes, "stores": stores}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        prev = before.get(key, 0)
        if isinstance(value, int | float) and isinstance(prev, int | float):
            d = value - prev
            out[key] = round(d, 6) if isinstance(d, float) else d
    return out


def snapshot_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    nodes = {}
    for name, entry in after["nodes"].items():
        prev = before["nodes"].get(name, {}).get("counters", {})
        nodes[name] = {**entry, "counters": _delta(entry.get("counters", {}), prev)}
    stores = {name: _delta(stats, before["stores"].get(name, {}))
              for name, stats in after["stores"].items()}
    return {"nodes": nodes, "stores": stores}


# --------------------------------------------------------------------------- modes


def _usage(store_paths: dict[str, str]) -> dict[str, dict[str, int]]:
    from kvcompose.stores import store_usage

    return {name: store_usage(path) for name, path in store_paths.items()}


def run_measure(job: dict[str, Any]) -> dict[str, Any]:
    from kvcompose.testing.engine import make_llm

    workload = json.loads(Path(job["workload_file"]).read_text())
    requests = workload["requests"]
    store_paths: dict[str, str] = job.get("stores", {})
    result: dict[str, Any] = {"ok": False, "label": job["label"], "seed": job["seed"]}
    progress(phase="start", done=0, total=len(requests))
    t0 = time.perf_counter()
    with make_llm(job["model"], job.get("kv_transfer_config"), **job["engine"]) as llm:
        engine = llm.llm_engine
        result["engine_start_s"] = round(time.perf_counter() - t0, 3)
        t = time.perf_counter()
        warm = [{"id": f"warmup-{i}", "prompt": p, "arrival_s": 0.0,
                 "max_tokens": job.get("warmup_max_tokens", 4)}
                for i, p in enumerate(job.get("warmup", []))]
        if warm:
            replay(engine, warm, phase="warmup", timed=False, timeout_s=job.get("timeout_s"))
        result["warmup_s"] = round(time.perf_counter() - t, 3)
        before = connector_snapshot(llm, store_paths)
        usage_before = _usage(store_paths)
        t = time.perf_counter()
        records = replay(engine, requests, phase="replay",
                         timed=job.get("timed", True), timeout_s=job.get("timeout_s"))
        result["replay_s"] = round(time.perf_counter() - t, 3)
        after = connector_snapshot(llm, store_paths)
        usage_after = _usage(store_paths)
        result["connector"] = snapshot_delta(after, before)
        result["store_usage"] = {name: {"before": usage_before[name],
                                        "after": usage_after[name]} for name in store_paths}
        leftovers = {}
        try:
            sched = engine.engine_core.engine_core.scheduler.connector
            live = getattr(sched, "live_requests", None)
            if callable(live):
                leftovers = live()
        except AttributeError:
            pass
        result["live_requests_after"] = leftovers
    result["requests"] = [records[r["id"]] for r in requests]
    result["total_s"] = round(time.perf_counter() - t0, 3)
    result["ok"] = True
    return result


def run_prefill(job: dict[str, Any]) -> dict[str, Any]:
    from kvcompose.testing.engine import greedy, make_llm

    out: dict[str, Any] = {"ok": False, "stores": {}}
    jobs = job["stores"]
    for i, store in enumerate(jobs):
        prompts = json.loads(Path(store["prompts_file"]).read_text())
        progress(phase="prefill", store=store["name"], done=i, total=len(jobs))
        t = time.perf_counter()
        with make_llm(job["model"], store["kv_transfer_config"], **job["engine"]) as llm:
            # A few at a time: the store saves what each step computed.
            for k in range(0, len(prompts), 8):
                greedy(llm, prompts[k:k + 8], 1)
        from kvcompose.stores import store_usage

        out["stores"][store["name"]] = {"seconds": round(time.perf_counter() - t, 3),
                                        "prompts": len(prompts),
                                        "usage": store_usage(store["path"])}
    progress(phase="prefill", done=len(jobs), total=len(jobs))
    out["ok"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kvcompose.bench.runner JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    from kvcompose.testing.engine import engine_env

    engine_env()
    result_file = Path(job["result_file"])
    try:
        result = run_prefill(job) if job["mode"] == "prefill" else run_measure(job)
    except BaseException as exc:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}
        result_file.write_text(json.dumps(result))
        return 1
    result_file.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
