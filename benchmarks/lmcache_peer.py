"""kvcompose's store beside LMCache's multi-process mode, on chat and document QA.

    flock /tmp/kvcompose-engine.lock .venv-lmcache/bin/python benchmarks/lmcache_peer.py

runs ``kvcompose bench`` once per workload (``--workloads``, default ``chat,docqa``) with seven
contenders in rotated rounds (``--repeats``, default 5):

- ``recompute``: no connector;
- ``store``: kvcompose's ``PrefixStoreConnector`` on tmpfs, given to vLLM directly;
- ``lmcache``: vLLM's ``LMCacheMPConnector`` against one ``lmcache server``, given directly;
- ``lmcache-leaf``: the same connector as the only leaf of a kvcompose tree;
- ``longest``, ``fastest``: a kvcompose chain [store, lmcache] with that policy;
- ``fastest-told``: ``fastest`` with both tiers' load speeds stated (``TOLD``), so nothing is
  probed: beside ``longest`` it shows what probing costs, beside the store alone what the
  chain costs (it asks LMCache about every request, a round trip to its server).

Every contender starts from the same content: the workload's ``disk`` set (each returning
user's history; each whole document). The bench prepares the store once and gives every run
a fresh copy; the server is cleared (``POST /cache/clear``) and filled with the same prompts
by an engine that keeps running beside the measured ones before every run that uses
LMCache, so no run finds what an earlier run saved. After every run the bench removes the
shared-memory segments no process maps any more, and restarts the server (and its filler)
once it holds ``ORPHANS_BEFORE_RESTART`` segments of engines that ended: the server keeps
each engine's KV cache segment (1 GiB) mapped until it restarts, and about twenty fill a
24 GiB machine. LMCache's chunk is the engines' block
(128 tokens), so both tiers find the same hits as long as LMCache's memory tier
(``--l1-size-gb``, default 2) holds the working set: at 0.25 GB it holds about 8,000 of
the built-in model's tokens (32 KiB each) and evicts. The server and the engines run with the
LMCache test bed's settings (``kvcompose.testing.lmcache_server``: the dispatcher
workaround, ``lmcache_driven`` transfers).

Results go to ``benchmarks/results/lmcache_peer/<workload>/`` (the bench's report),
``server.json`` (the server's settings) and ``summary.md``: per round, each contender's TTFT p50 and
the paired ratios the comparison asks for (store / LMCache, leaf / LMCache, fastest and
fastest-told / the better of store and LMCache alone). Extra arguments go to ``kvcompose bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvcompose.bench import jobs
from kvcompose.bench import run as bench_run
from kvcompose.bench.results import RunResult
from kvcompose.bench.summary import paired_ratios
from kvcompose.testing.lmcache_server import LMCacheServer

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "lmcache_peer"
#: the bench engine's block size on CPU; LMCache's chunk is set to it
BLOCK = 128
#: the prepared content every contender starts from (a store name of the built-in workloads)
PREFILLED = "disk"
#: ``fastest-told``'s priors: the store reads tmpfs at about 4 GB/s, LMCache retrieves at
#: about 1.7 GB/s behind a round trip to its server (``benchmarks/store_io.py`` and this
#: benchmark's earlier runs measure both on 2 cores)
TOLD = {
    "store": {"latency_ms": 1.0, "gbps": 4.0},
    "lmcache": {"latency_ms": 10.0, "gbps": 1.7},
}
#: restart the server once it maps this many segments no live engine maps (1 GiB each)
ORPHANS_BEFORE_RESTART = 4
#: workload sizes: 16 measured requests a run on chat, 32 on document QA, so that one slow
#: request moves a run's p50 little; a round takes about 5 min on chat, 7 on document QA, on
#: 2 cores
SIZES = {
    "chat": ["--users", "8", "--rounds", "2", "--new-users", "2"],
    "docqa": ["--docs", "2", "--questions", "16"],
}


def store_leaf() -> dict[str, Any]:
    return {
        "name": "store",
        "connector": "PrefixStoreConnector",
        "module_path": "kvcompose.stores",
        "extra_config": {"path": f"{{tmpfs:{PREFILLED}}}"},
    }


def contender_files(server: LMCacheServer, folder: Path) -> list[str]:
    """Write the contender files; return the bench's ``-c`` arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    lmcache = {"name": "lmcache", "connector": "LMCacheMPConnector",
               "extra_config": server.extra_config()}  # fmt: skip
    store = store_leaf()
    direct_store = {
        "kv_connector": store["connector"],
        "kv_connector_module_path": store["module_path"],
        "kv_role": "kv_both",
        "kv_connector_extra_config": store["extra_config"],
    }
    files: dict[str, tuple[str, Any]] = {
        "store": ("json", direct_store),
        "lmcache": ("json", server.connector_config()),
        "lmcache-leaf": ("yaml", {"version": 1, "kv_role": "kv_both", "tree": {"leaf": lmcache}}),
    }
    told = [{**leaf, "expect_read": TOLD[leaf["name"]]} for leaf in (store, lmcache)]
    chains = {"longest": [store, lmcache], "fastest": [store, lmcache], "fastest-told": told}
    for label, leaves in chains.items():
        policy = label.split("-")[0]
        tree = {"chain": {"name": "tiers", "policy": policy,
                          "children": [{"leaf": leaf} for leaf in leaves]}}  # fmt: skip
        files[label] = ("yaml", {"version": 1, "kv_role": "kv_both", "tree": tree})
    args = ["-c", "recompute"]
    for label, (fmt, data) in files.items():
        path = folder / f"{label}.{fmt}"
        text = json.dumps(data, indent=1) if fmt == "json" else yaml.safe_dump(data)
        path.write_text(text)
        args += ["-c", f"{label}={path}"]
    return args


class Refill:
    """Before every run that uses LMCache: clear the server and store the workload's
    prepared prompts again, through an engine that stays up for the whole bench run (it
    forks from the bench's preloaded server like the measured engines, with the same engine
    settings)."""

    def __init__(self, server: LMCacheServer) -> None:
        self.server = server
        self.stack = contextlib.ExitStack()
        self.filler: Any = None
        self.runs = 0

    def __call__(
        self, run: jobs.Session, c: Any, wl: Any, warm: Any, seed: int, round_no: int, *rest: Any
    ) -> RunResult:
        try:
            ktc = c.resolved.kv_transfer_config if c.resolved is not None else None
            if ktc is not None and "LMCacheMPConnector" in json.dumps(ktc):
                try:
                    self.refill(run, wl, seed)
                except Exception as exc:  # this run fails, the bench goes on
                    self.close()  # the next run starts a filler (and, if need be, a server)
                    error = f"LMCache refill failed: {type(exc).__name__}: {exc}"
                    run.log(f"contender {c.label!r}: {error}")
                    return RunResult(label=c.label, seed=seed, round=round_no, error=error)
            return ORIGINAL_RUN(run, c, wl, warm, seed, round_no, *rest)
        finally:
            self.tidy(run)

    def tidy(self, run: jobs.Session) -> None:
        """After every run (its engine has ended): restart the server
        once it holds ``ORPHANS_BEFORE_RESTART`` segments only it maps, then remove the
        segments nobody maps. A failed restart is logged; the next refill tries again."""
        try:
            orphaned = self.server.orphaned_segments()
            if len(orphaned) >= ORPHANS_BEFORE_RESTART:
                run.log(f"restarting the LMCache server: it holds {len(orphaned)} segments "
                        f"no engine maps ({', '.join(orphaned)})")  # fmt: skip
                self.restart_server()
        except Exception as exc:
            run.log(f"LMCache server restart failed: {type(exc).__name__}: {exc}")
        self.server.clear_shm()

    def restart_server(self) -> None:
        """Restart the server, and the filler with it: a client notices a restart only when
        its heartbeat saw the server down, and the new server refuses the saves of one that
        did not (``CLIENT_HEARTBEAT_S``); the next refill starts a new filler."""
        self.close()
        self.server.restart()

    def refill(self, run: jobs.Session, wl: Any, seed: int) -> None:
        if not self.server.alive():  # killed (the OOM killer took it once)
            self.restart_server()
        if self.filler is None:
            self.filler = self.stack.enter_context(
                jobs._engine(run.opts, run.model_dir, self.server.connector_config(), seed,
                             run.out / "runs" / "_lmcache_filler", "lmcache-filler")
            )  # fmt: skip
        body = json.dumps({"tier": "l1", "force": True}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.http_port}/cache/clear",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
        self.filler.call("kvcompose.bench.replay:prefill", wl.prefill.get(PREFILLED, []))
        if not self.filler.wait_idle(120):  # its saves reached the server
            raise RuntimeError("the LMCache filler's saves did not finish")
        self.runs += 1

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.close()
        self.stack = contextlib.ExitStack()
        self.filler = None


ORIGINAL_RUN = jobs.run_contender


def summary(results: dict[str, dict[str, Any]], server: dict[str, Any]) -> str:
    """The per-round TTFT p50s and the paired ratios, as Markdown; ``server``: the LMCache
    server's settings (``server.json``)."""
    lines = [
        "# kvcompose's store beside LMCache's multi-process mode",
        "",
        f"LMCache server: chunk {server['chunk_size']} tokens, L1 {server['l1_size_gb']:g} GB "
        "(no L2); the store: tmpfs, unbounded.",
        "",
    ]
    for workload, res in results.items():
        by = {c["label"]: c for c in res["contenders"]}
        meta = res["meta"]
        lines += [
            f"## {workload}",
            "",
            f"{meta['started']}, {meta['machine']['cpus']} CPUs, vLLM {meta['vllm']}, "
            f"{meta['repeats']} rounds (order rotated), {meta['workload_description']}.",
            "",
            "| contender | TTFT p50 ms per round | speed-up over recompute (median) "
            "| prompt tokens from a tier, a replay | agreement |",
            "|---|---|---:|---:|---:|",
        ]
        for label, c in by.items():
            if c["status"] != "ok":
                lines.append(f"| {label} | {c['status']} | | | |")
                continue
            p50 = ", ".join(f"{v * 1000:.0f}" for v in c["ttft_p50_rounds"])
            speed = c.get("ttft_p50_speedup")
            agree = (c.get("agreement") or {}).get("percent")
            lines.append(
                f"| {label} | {p50} | {speed if speed is not None else '-'} "
                f"| {c['hits']['cached_tokens']:,} | "
                f"{'-' if agree is None else f'{agree:.0f} %'} |"
            )
        lines += ["", "| paired ratio of TTFT p50, round by round | median | range |",
                  "|---|---:|---|"]  # fmt: skip
        p50 = {
            label: c["ttft_p50_rounds"] if c["status"] == "ok" else [] for label, c in by.items()
        }
        store, lmc = p50.get("store", []), p50.get("lmcache", [])
        pairs = {
            "store / lmcache": (store, lmc),
            "lmcache-leaf / lmcache": (p50.get("lmcache-leaf", []), lmc),
            "longest / store": (p50.get("longest", []), store),
        }
        better = [min(s, m) for s, m in zip(store, lmc, strict=False)]
        for label in ("fastest", "fastest-told"):
            pairs[f"{label} / better of store and lmcache"] = (p50.get(label, []), better)
        for name, (num, den) in pairs.items():
            if not num or len(num) != len(den):
                lines.append(f"| {name} | not measured | |")
                continue
            p = paired_ratios(num, den)
            ratios = ", ".join(f"{r:.2f}" for r in p.ratios)
            lines.append(f"| {name} | {p.median:.2f} | {p.low:.2f}-{p.high:.2f} ({ratios}) |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="chat,docqa")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, each contender once")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--l1-size-gb",
        type=float,
        default=2.0,
        help="the server's memory tier; below the working set (about 0.3 GB on chat) it evicts",
    )
    args, bench_args = ap.parse_known_args(argv)
    from kvcompose.cli.main import main as kvcompose_main

    args.out.mkdir(parents=True, exist_ok=True)
    settings = {"chunk_size": BLOCK, "l1_size_gb": args.l1_size_gb}
    (args.out / "server.json").write_text(json.dumps(settings) + "\n")
    server = LMCacheServer(args.out / "_server", **settings)
    refill = Refill(server)
    results: dict[str, dict[str, Any]] = {}
    rc = 0
    with server:
        # every engine the bench starts (forked from a server it spawns once) needs these
        os.environ.update(server.spawn_env())
        bench_run.run_contender = refill
        contenders = contender_files(server, args.out / "contenders")
        try:
            for workload in args.workloads.split(","):
                out = args.out / workload
                rc |= kvcompose_main([
                    "bench", "--workload", workload, "--out", str(out),
                    "--repeats", str(args.repeats), *SIZES.get(workload, []),
                    *contenders, *bench_args,
                ])  # fmt: skip
                if (out / "results.json").is_file():
                    results[workload] = json.loads((out / "results.json").read_text())
        finally:
            refill.close()
            bench_run.run_contender = ORIGINAL_RUN
    text = summary(results, settings)
    (args.out / "summary.md").write_text(text)
    print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
