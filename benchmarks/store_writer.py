"""Engine step time with the store's saves off, written in the step (sync), and written by
the background writer.

Each run is a fresh single-process vLLM CPU engine (the built-in benchmark model, block size
128, local prefix cache off) with one PrefixStoreConnector on disk, in its own process. It
replays the same prompts (distinct, so every chunk is new and, unless saves are off, is
written), all submitted at once, and times every ``engine.step()``. Modes:

- ``off``: ``read_only: true`` (nothing saved; the store is empty, so nothing loaded either);
- ``sync``: ``save_mode: sync`` (today's default: files written in ``wait_for_save``);
- ``background``: ``save_mode: background`` (queued; the writer thread writes them while
  vLLM holds the requests' blocks).

Rounds run every mode once with the order rotated (round 1: off, sync, background; round
2: sync, background, off; ...). Per round, each mode's step-time ratio to ``off`` is taken
within the round; the table shows the per-round ratios side by side and their median.

Run: ``flock /tmp/kvcompose-engine.lock .venv/bin/python benchmarks/store_writer.py``
(about 6 minutes on 2 cores); results go to ``benchmarks/results/store_writer/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("off", "sync", "background")
HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "store_writer"


def store_extra(mode: str, path: str) -> dict[str, Any]:
    if mode == "off":
        return {"path": path, "read_only": True}
    return {"path": path, "save_mode": mode}


def one_run(mode: str, *, prompts: int, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """One engine, one mode: the per-step times of the replay."""
    from kvcompose.engine.llm import make_llm, sampling_params
    from kvcompose.engine.model import builtin_model
    from kvcompose.stores import store_usage

    model = builtin_model()
    with tempfile.TemporaryDirectory(dir=os.environ.get("STORE_DIR")) as tmp:
        path = os.path.join(tmp, "kv")
        cfg = {
            "kv_connector": "PrefixStoreConnector",
            "kv_connector_module_path": "kvcompose.stores",
            "kv_role": "kv_both",
            "kv_connector_extra_config": store_extra(mode, path),
        }
        with make_llm(
            model,
            cfg,
            block_size=128,
            max_model_len=4096,
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            enable_prefix_caching=False,
        ) as llm:
            from vllm.inputs import TokensPrompt

            eng = llm.llm_engine
            # Warm-up: one unrelated short request.
            eng.add_request("warm", TokensPrompt(prompt_token_ids=[5] * 300), sampling_params(2))
            while eng.has_unfinished_requests():
                eng.step()
            for i in range(prompts):
                ids = [4 + (97 * i + 31 * j + (j * j) % 13) % 1000 for j in range(prompt_len)]
                eng.add_request(
                    f"r{i}", TokensPrompt(prompt_token_ids=ids), sampling_params(max_tokens)
                )
            steps: list[float] = []
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                s = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - s)
            replay_s = time.perf_counter() - t0
            # Background: the engine keeps stepping until the held blocks are released.
            t1 = time.perf_counter()
            core = getattr(eng, "engine_core", None)
            inner = getattr(core, "engine_core", None)
            sched = getattr(inner, "scheduler", None)
            while sched is not None and sched.has_requests():
                inner.step_fn()
            drain_s = time.perf_counter() - t1
            worker = llm.collective_rpc(_worker_stats)[0]
        usage = store_usage(path)
    return {
        "mode": mode,
        "steps": len(steps),
        "step_mean_s": statistics.fmean(steps),
        "step_p50_s": statistics.median(steps),
        "step_p90_s": statistics.quantiles(steps, n=10)[-1],
        "step_max_s": max(steps),
        "replay_s": replay_s,
        "drain_s": drain_s,
        "files": usage["files"],
        "bytes_written": usage["bytes"],
        # sync: seconds inside the engine step; background: seconds on the writer thread
        "save_time_s": worker.get("save_time_s", 0.0),
        "saves_dropped": worker.get("saves_dropped", 0),
    }


def _worker_stats(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().total_stats.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    kw = {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    if args.one:
        print("RESULT " + json.dumps(one_run(args.one, **kw)), flush=True)
        return

    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = [MODES[(r + i) % len(MODES)] for i in range(len(MODES))]
        results: dict[str, dict[str, Any]] = {}
        for mode in order:
            cmd = [sys.executable, __file__, "--one", mode]
            cmd += ["--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len)]
            cmd += ["--max-tokens", str(args.max_tokens)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"round {r + 1} {mode}: no result (rc {proc.returncode})")
            results[mode] = json.loads(line[len("RESULT ") :])
            res = results[mode]
            print(
                f"round {r + 1} {mode:10s} step mean {res['step_mean_s'] * 1e3:7.1f} ms "
                f"p90 {res['step_p90_s'] * 1e3:7.1f} ms  replay {res['replay_s']:5.2f} s  "
                f"drain {res['drain_s']:5.2f} s  written {res['bytes_written'] / 2**20:6.1f} MiB",
                flush=True,
            )
        rounds.append(results)
    table = report(rounds)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"params": kw, "rounds": rounds}, indent=2) + "\n"
    )
    (args.out / "results.md").write_text(table + "\n")


def report(rounds: list[dict[str, dict[str, Any]]]) -> str:
    n = len(rounds)
    head = "| mode | " + " | ".join(f"round {i + 1}" for i in range(n)) + " | median |"
    lines = [
        "Step time (mean over the replay's steps), ratio to saves off within each round:",
        "",
        head,
        "|---|" + "---:|" * (n + 1),
    ]
    for mode in MODES:
        ratios = [r[mode]["step_mean_s"] / r["off"]["step_mean_s"] for r in rounds]
        cells = [
            f"{r[mode]['step_mean_s'] * 1e3:.0f} ms ({x:.2f}x)"
            for r, x in zip(rounds, ratios, strict=True)
        ]
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {statistics.median(ratios):.2f}x |")
    lines += [
        "",
        "Per round: p90 step time, replay and drain (s), MiB written, seconds spent writing "
        "(sync: inside the step; background: on the writer thread), saves dropped:",
        "",
    ]
    lines.append("| mode | p90 step ms | replay s | drain s | MiB written | write s | dropped |")
    lines.append("|---|---|---|---|---|---|---|")
    for mode in MODES:
        vals = [r[mode] for r in rounds]
        lines.append(
            f"| {mode} | "
            + " / ".join(f"{v['step_p90_s'] * 1e3:.0f}" for v in vals)
            + " | "
            + " / ".join(f"{v['replay_s']:.1f}" for v in vals)
            + " | "
            + " / ".join(f"{v['drain_s']:.1f}" for v in vals)
            + " | "
            + " / ".join(f"{v['bytes_written'] / 2**20:.0f}" for v in vals)
            + " | "
            + " / ".join(f"{v.get('save_time_s', 0.0):.2f}" for v in vals)
            + " | "
            + " / ".join(str(v.get("saves_dropped", 0)) for v in vals)
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
