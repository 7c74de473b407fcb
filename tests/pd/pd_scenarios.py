"""Prefill/decode scenarios over real NIXL between two engine processes, measured.

Used by ``test_pd_scenarios.py`` (kvcompose trees, asserted in CI) and runnable by hand to
produce the figures in docs/pd.md, for kvcompose or for vLLM's own MultiConnector over the
same children::

    flock /tmp/kvcompose-engine.lock .venv/bin/python tests/pd/pd_scenarios.py \\
        --connector multiconnector [--observe-seed-bug 60]

Both engines run the tiny model with a 32-token block size, a kvcompose tree (or a
MultiConnector) holding NixlConnector (UCX, host memory, ``kv_lease_duration`` 300 s) and a
PrefixStoreConnector disk tier, each engine with its own store directory:

- P (prefill): ``chain/first[nixl, disk]``;
- D (decode): ``chain/first[disk, nixl]``, ``chain/longest[disk, nixl]`` or
  ``chain/stitch[disk, nixl]`` (``test_pd_stitch.py``).

A hand-off is the proxy flow: P runs the prompt with ``max_tokens=1`` and
``{"do_remote_decode": true}``; D runs it with the ``kv_transfer_params`` P returned. Both
engines record (``kvcompose.testing.pd.trace_on``) every lookup and allocation each
connector of the tree sees, and every block free, with ``time.monotonic()`` stamps, one clock
for both processes. "P holds blocks" is measured from D's allocation of the request to P's
free of the prefill request's blocks, in seconds and in P's engine steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvcompose.testing import pd
from kvcompose.testing.pd import EngineProcess, is_clean
from kvcompose.testing.ports import free_port
from kvcompose.testing.trees import chain, kvcompose_config, multiconnector_config

#: NIXL's lease on P's blocks (vLLM's ``kv_lease_duration``, seconds; default 30). Long, so
#: a P engine that is only freed by the lease would hold its blocks for minutes.
LEASE_S = 300
BLOCK = 32
PROMPT_LEN = 200  # 6 full blocks + 8 tokens
FULL_PREFIX = (PROMPT_LEN - 1) // BLOCK * BLOCK  # what a store can hold: blocks in prompt[:-1]
D_TOKENS = 24  # D decodes long enough that "freed before D's request ended" means something
#: The bound the tests assert on P's hold after D's allocation (the lease is 300 s).
FREE_WITHIN_S = 5.0
LLM_KWARGS: dict[str, Any] = {"block_size": BLOCK}


def prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    """Deterministic token ids; prompts of different seeds share no prefix."""
    return [(seed * 7919 + i * 31 + (i * i) % 17 + seed) % 1000 + 4 for i in range(n)]


# ----------------------------------------------------------------------------- configs


def nixl_leaf(lease_s: int = LEASE_S) -> dict[str, Any]:
    return {
        "kind": "leaf",
        "name": "nixl",
        "connector": "NixlConnector",
        "extra_config": {"backends": ["UCX"], "kv_lease_duration": lease_s},
    }


def disk_leaf(path: Path | str, name: str = "disk") -> dict[str, Any]:
    return {
        "kind": "leaf",
        "name": name,
        "connector": "PrefixStoreConnector",
        "module_path": "kvcompose.stores",
        "extra_config": {"path": str(path)},
    }


def kvcompose_configs(
    stores: Path, d_policy: str = "first"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """P = chain/first[nixl, disk]; D = chain/<d_policy>[disk, nixl]."""
    p = kvcompose_config(chain("p", nixl_leaf(), disk_leaf(stores / "p")), kv_buffer_device="cpu")
    d = kvcompose_config(
        chain("d", disk_leaf(stores / f"d-{d_policy}"), nixl_leaf(), policy=d_policy),
        kv_buffer_device="cpu",
    )
    return p, d


def multiconnector_configs(stores: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's MultiConnector over the same children (first non-zero hit loads)."""
    p = multiconnector_config(nixl_leaf(), disk_leaf(stores / "p"), kv_buffer_device="cpu")
    d = multiconnector_config(disk_leaf(stores / "d-mc"), nixl_leaf(), kv_buffer_device="cpu")
    for cfg in (p, d):  # MultiConnector children inherit nothing from the top level
        for child in cfg["kv_connector_extra_config"]["connectors"]:
            child["kv_buffer_device"] = "cpu"
    return p, d


def start_engine(
    model: Path | str, config: dict[str, Any], name: str, **llm_kwargs: Any
) -> EngineProcess:
    """An engine process with its own NIXL side-channel port, tracing on, forked from the
    server that has imported vLLM once (``preloaded``)."""
    engine = EngineProcess(
        model,
        config,
        name=name,
        llm_kwargs={**LLM_KWARGS, **llm_kwargs},
        env=pd.engine_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
        preloaded=True,
    )
    try:
        engine.call(pd.trace_on)
    except BaseException:
        engine.close()
        raise
    return engine


# ----------------------------------------------------------------------------- measuring


def leaf_kind(node: str) -> str | None:
    """``nixl`` / ``disk`` for a node path of either tree (kvcompose node names or
    MultiConnector's ``<index>.<class>``), None for the root."""
    low = node.lower()
    if "nixl" in low:
        return "nixl"
    if "disk" in low or "prefixstore" in low:
        return "disk"
    return None


def nixl_totals(stats: dict[str, Any] | None) -> tuple[int, float, int]:
    """(transfers, bytes, external prefix-hit tokens) from an engine's Prometheus stats."""
    if not stats:
        return 0, 0.0, 0
    moved = stats.get("vllm:nixl_bytes_transferred") or {"count": 0, "sum": 0.0}
    return (
        int(moved["count"]),
        float(moved["sum"]),
        int(stats.get("vllm:external_prefix_cache_hits", 0)),
    )


@dataclasses.dataclass
class Handoff:
    """What one P→D hand-off did and how long P held its blocks."""

    prompt_len: int
    p_request: str
    d_request: str
    p_blocks: int  # blocks P held for D after the prefill
    d_tokens: list[int]
    d_cached: int  # D's num_cached_tokens (local + external)
    d_local: int | None  # D's local prefix hit shown to the connectors
    d_computed: int  # tokens D's engine computed for the request (prompt and decode)
    offers: dict[str, tuple[int | None, bool]]  # what each child answered D's lookup
    allocs: dict[str, int]  # tokens each child was told at D's allocation
    owner: str | None  # the child told n > 0
    t_d_alloc: float
    t_p_free: float | None
    t_d_done: float | None  # D freed the request's blocks (its request ended)
    p_steps: int | None  # P's engine steps from D's allocation to P's free
    transfers: int | None  # NIXL transfers D made (None: stats off)
    bytes_moved: float | None
    external_hits: int | None
    dropped: int  # calls dropped by fault injection (negative controls)
    params: dict[str, Any] | None = None  # the kv_transfer_params P returned

    @property
    def d_prompt_computed(self) -> int:
        """Prompt tokens D computed itself: every step after the prompt's last samples one
        decoded token (the first one comes with the prompt's last token)."""
        return self.d_computed - (len(self.d_tokens) - 1)

    @property
    def hold_s(self) -> float | None:
        """Seconds P held the request's blocks after D allocated it."""
        return None if self.t_p_free is None else self.t_p_free - self.t_d_alloc

    @property
    def freed_before_d_done(self) -> bool:
        return (
            self.t_p_free is not None
            and self.t_d_done is not None
            and self.t_p_free < self.t_d_done
        )

    def row(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "allocs": self.allocs,
            "offers": self.offers,
            "local": self.d_local,
            "cached": self.d_cached,
            "computed": self.d_computed,
            "external": self.external_hits,
            "transfers": self.transfers,
            "bytes": self.bytes_moved,
            "hold_ms": None if self.hold_s is None else round(self.hold_s * 1000, 1),
            "p_steps": self.p_steps,
            "freed_before_d_done": self.freed_before_d_done,
        }


def p_request_freed(request_id: str) -> Any:
    return lambda snap: request_id not in snap["requests"]


def handoff(
    p: EngineProcess,
    d: EngineProcess,
    tokens: list[int],
    max_tokens: int = D_TOKENS,
    *,
    stats: bool = True,
    corrupt_p: bool = False,
    tamper: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    p_free_timeout: float = 30.0,
    d_request_id: str | None = None,
) -> Handoff:
    """The proxy flow for one prompt, measured. ``corrupt_p`` overwrites P's KV blocks of
    the request with noise before D reads them (a negative control); ``tamper`` changes the
    ``kv_transfer_params`` D is handed (fault injection); ``d_request_id`` names D's request
    (a fault-injecting store matches it). Waits up to ``p_free_timeout`` s for P to free the
    prefill request's blocks."""
    before = nixl_totals(d.stats()) if stats else None
    (p_out,) = p.call(pd.run_requests, [tokens], 1, {"do_remote_decode": True})
    p_req = p_out["request_id"]
    params = p_out["kv_transfer_params"]
    assert params and params.get("do_remote_prefill"), f"P returned no hand-off: {params}"
    p_snap = p.inspect()
    p_blocks = p_snap["requests"][p_req]["blocks"] if p_req in p_snap["requests"] else 0
    if corrupt_p:
        assert p.call(pd.corrupt_request_blocks, p_req) > 0
    d_params = params if tamper is None else tamper(dict(params))
    d_ids = None if d_request_id is None else [d_request_id]
    (d_out,) = d.call(pd.run_requests, [tokens], max_tokens, d_params, request_ids=d_ids)
    d_req = d_out["request_id"]
    p.wait_until(p_request_freed(p_req), p_free_timeout)
    after = nixl_totals(d.stats()) if stats else None
    p_trace, d_trace = p.call(pd.take_trace), d.call(pd.take_trace)

    d_side = _decode_side(d_trace["events"], d_req)
    t_alloc = d_side["t_alloc"]
    t_free = next(
        (ev["t"] for ev in p_trace["events"] if ev["kind"] == "free" and ev["req"] == p_req), None
    )
    p_steps = None
    if t_free is not None:
        p_steps = sum(1 for t in p_trace["step_times"] if t_alloc <= t <= t_free)
    return Handoff(
        prompt_len=len(tokens),
        p_request=p_req,
        d_request=d_req,
        p_blocks=p_blocks,
        d_tokens=d_out["token_ids"],
        d_cached=d_out["num_cached_tokens"],
        d_local=d_side["local"],
        d_computed=d_trace["scheduled"].get(d_req, 0),
        offers=d_side["offers"],
        allocs=d_side["allocs"],
        owner=d_side["owner"],
        t_d_alloc=t_alloc,
        t_p_free=t_free,
        t_d_done=d_side["t_done"],
        p_steps=p_steps,
        **_deltas(before, after),
        dropped=d_side["dropped"],
        params=params,
    )


def decode_only(
    d: EngineProcess, tokens: list[int], max_tokens: int = D_TOKENS, *, stats: bool = True
) -> Handoff:
    """D runs the prompt with no hand-off (no P involved), measured like ``handoff``."""
    before = nixl_totals(d.stats()) if stats else None
    (d_out,) = d.call(pd.run_requests, [tokens], max_tokens)
    after = nixl_totals(d.stats()) if stats else None
    d_trace = d.call(pd.take_trace)
    d_side = _decode_side(d_trace["events"], d_out["request_id"])
    return Handoff(
        prompt_len=len(tokens),
        p_request="",
        d_request=d_out["request_id"],
        p_blocks=0,
        d_tokens=d_out["token_ids"],
        d_cached=d_out["num_cached_tokens"],
        d_local=d_side["local"],
        d_computed=d_trace["scheduled"].get(d_out["request_id"], 0),
        offers=d_side["offers"],
        allocs=d_side["allocs"],
        owner=d_side["owner"],
        t_d_alloc=d_side["t_alloc"],
        t_p_free=None,
        t_d_done=d_side["t_done"],
        p_steps=None,
        **_deltas(before, after),
        dropped=d_side["dropped"],
    )


def _deltas(
    before: tuple[int, float, int] | None, after: tuple[int, float, int] | None
) -> dict[str, Any]:
    if before is None or after is None:
        return {"transfers": None, "bytes_moved": None, "external_hits": None}
    return {
        "transfers": after[0] - before[0],
        "bytes_moved": after[1] - before[1],
        "external_hits": after[2] - before[2],
    }


def _decode_side(events: list[dict[str, Any]], d_req: str) -> dict[str, Any]:
    """What D's tree did for one request: each child's first lookup answer and allocation,
    the local hit, when D allocated and freed it, calls dropped by fault injection."""
    offers: dict[str, tuple[int | None, bool]] = {}
    allocs: dict[str, int] = {}
    out: dict[str, Any] = {
        "local": None,
        "t_alloc": None,
        "t_done": None,
        "dropped": 0,
        "offers": offers,
        "allocs": allocs,
    }
    for ev in events:
        if ev["req"] != d_req:
            continue
        kind = leaf_kind(ev.get("node", ""))
        if ev["kind"] == "lookup":
            if kind is None:
                out["local"] = ev["local"]
            else:
                offers.setdefault(kind, tuple(ev["result"]))  # type: ignore[arg-type]
        elif ev["kind"] == "alloc":
            if out["t_alloc"] is None:
                out["t_alloc"] = ev["t"]
            if kind is not None:
                allocs.setdefault(kind, ev["tokens"])
        elif ev["kind"] == "free":
            out["t_done"] = ev["t"]
        elif ev["kind"] == "dropped":
            out["dropped"] += 1
    assert out["t_alloc"] is not None, f"D never allocated {d_req}: {events}"
    owners = [k for k, n in allocs.items() if n > 0]
    out["owner"] = owners[0] if owners else None
    return out


def seed_disk(d: EngineProcess, tokens: list[int]) -> None:
    """Make D's disk tier hold ``tokens``' prefix but not D's local prefix cache: D computes
    the prompt itself (its disk tier saves every full block of it), then drops its local
    prefix cache."""
    d.call(pd.run_requests, [tokens], 1)
    assert d.call(pd.reset_prefix_cache), "D's prefix cache could not be reset"
    d.call(pd.take_trace)


def assert_crossed(h: Handoff) -> None:
    """KV crossed from P to D over NIXL: NIXL owned the whole prompt, moved bytes, and D
    counts the prompt as external prefix-cache hits (``vllm:external_prefix_cache_hits``;
    vLLM 0.32 reports ``num_cached_tokens`` 0 for a remote prefill)."""
    assert h.owner == "nixl" and h.allocs.get("nixl") == h.prompt_len, h.row()
    assert h.transfers is not None and h.transfers >= 1 and h.bytes_moved, h.row()
    assert h.external_hits == h.prompt_len, h.row()


def assert_p_freed_fast(h: Handoff) -> None:
    """P got the blocks back well inside the lease, and before D's request ended (P's idle
    engine steps every few ms, as ``EngineCore``'s busy loop would, so its step count
    measures time, not what freed the blocks)."""
    assert h.hold_s is not None, f"P still holds {h.p_blocks} blocks: {h.row()}"
    assert h.hold_s < FREE_WITHIN_S, h.row()
    assert h.freed_before_d_done, h.row()


def clean(engine: EngineProcess, timeout: float = 20.0) -> dict[str, Any]:
    """The engine's snapshot once it holds nothing (fails after ``timeout`` s)."""
    snap = engine.wait_until(is_clean, timeout)
    if snap is None:
        snap = engine.inspect()
        raise AssertionError(f"{engine.name} still holds something: {snap}")
    return snap


def assert_clean(*engines: EngineProcess, timeout: float = 20.0) -> None:
    """No request, no used block, empty kvcompose and NIXL tables on every engine."""
    for engine in engines:
        clean(engine, timeout)


# ----------------------------------------------------------------------------- by hand


@contextlib.contextmanager
def engines(
    model: Path | str, configs: tuple[dict[str, Any], dict[str, Any]], **llm_kwargs: Any
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p = start_engine(model, configs[0], "prefill", **llm_kwargs)
    try:
        d = start_engine(model, configs[1], "decode", **llm_kwargs)
        try:
            yield p, d
        finally:
            d.close(graceful=False)  # nothing of the engines is read after the test
    finally:
        p.close(graceful=False)


def reference(
    model: Path | str, prompts: list[list[int]], max_tokens: int = D_TOKENS
) -> list[list[int]]:
    """Greedy outputs of a single engine without any connector."""
    from kvcompose.engine.llm import greedy, make_llm

    with make_llm(model, **LLM_KWARGS) as llm:
        return greedy(llm, prompts, max_tokens)


def run_all(
    p: EngineProcess, d: EngineProcess, ref: dict[int, list[int]], *, stats: bool, label: str
) -> list[tuple[str, dict[str, Any]]]:
    """Every scenario on one P/D pair, in order; returns (name, measurement) rows."""
    rows: list[tuple[str, dict[str, Any]]] = []

    def record(name: str, row: dict[str, Any]) -> None:
        print(f"[{label}] {name}: {row}", flush=True)
        rows.append((name, row))

    def measured(name: str, h: Handoff, seed: int) -> None:
        record(name, {"output_matches": h.d_tokens == ref[seed], **h.row()})

    handoff(p, d, prompt(10), stats=stats)  # the NIXL handshake, out of the measurements
    measured("1 cold D", handoff(p, d, prompt(11), stats=stats), 11)
    seed_disk(d, prompt(12))
    measured("2 disk holds 192", handoff(p, d, prompt(12), stats=stats), 12)
    seed_disk(d, prompt(13)[:70])
    measured("3 disk holds 64", handoff(p, d, prompt(13), stats=stats), 13)
    seed_disk(d, prompt(14))
    measured("3 disk holds 192", handoff(p, d, prompt(14), stats=stats), 14)
    handoff(p, d, prompt(15), stats=stats)
    measured("4 full local hit", handoff(p, d, prompt(15), stats=stats), 15)

    (p_out,) = p.call(pd.run_requests, [prompt(16)], 1, {"do_remote_decode": True})
    state = d.call(
        pd.submit_and_abort, prompt(16), D_TOKENS, p_out["kv_transfer_params"], when="loading"
    )
    record("5 abort on D while loading", _after_abort(p, d, p_out["request_id"], state))
    state = p.call(pd.submit_and_abort, prompt(17), 4, {"do_remote_decode": True}, when="prefilled")
    record("5 abort on P after prefill", _after_abort(p, d, state["request_id"], state))
    (p_out,) = p.call(pd.run_requests, [prompt(18)], 1, {"do_remote_decode": True})
    state = d.call(
        pd.submit_and_abort, prompt(18), D_TOKENS, p_out["kv_transfer_params"], when="queued"
    )
    record("5 D aborts before scheduling", _after_abort(p, d, p_out["request_id"], state))
    return rows


def _after_abort(
    p: EngineProcess, d: EngineProcess, p_req: str, state: dict[str, Any]
) -> dict[str, Any]:
    """After an abort: how long P kept the request's blocks (from the abort), whether D
    kept the aborted request's blocks until its load finished, both engines clean."""
    p.wait_until(p_request_freed(p_req), 30)
    p_clean, d_clean = is_clean(clean(p)), is_clean(clean(d))
    p_events, d_events = p.call(pd.take_trace)["events"], d.call(pd.take_trace)["events"]
    p_free = next((e["t"] for e in p_events if e["kind"] == "free" and e["req"] == p_req), None)
    d_free = next(
        (e["t"] for e in d_events if e["kind"] == "free" and e["req"] == state["request_id"]), None
    )
    return {
        "aborted_in": state["status"],
        "steps_before_abort": state["steps"],
        "p_hold_after_abort_ms": None if p_free is None else round((p_free - state["t"]) * 1000, 1),
        "d_free_after_abort_ms": None if d_free is None else round((d_free - state["t"]) * 1000, 1),
        "p_clean": p_clean,
        "d_clean": d_clean,
    }


def observe_seed_bug(p: EngineProcess, d: EngineProcess, seconds: float) -> dict[str, Any]:
    """The seed bug itself: D's composite stops talking to NIXL once another child owns
    the load (no 0-token allocation, no finish: the scheduler finishes a request on a
    connector that supports the hybrid KV cache manager, ``MultiConnector`` and its children
    included, through ``request_finished_all_groups``, in ``Scheduler._connector_finished``).
    Watches P for ``seconds``."""
    finishes = ("request_finished", "request_finished_all_groups")
    d.call(pd.drop_calls, _node(d, "nixl"), "update_state_after_alloc", zero_only=True)
    for method in finishes:
        d.call(pd.drop_calls, _node(d, "nixl"), method)
    try:
        seed_disk(d, prompt(19))
        (p_out,) = p.call(pd.run_requests, [prompt(19)], 1, {"do_remote_decode": True})
        d.call(pd.run_requests, [prompt(19)], D_TOKENS, p_out["kv_transfer_params"])
        t0 = time.monotonic()
        freed = p.wait_until(p_request_freed(p_out["request_id"]), seconds, interval=1.0)
        held = (freed["t"] - t0) if freed is not None else None
        return {
            "observed_s": seconds,
            "p_freed_after_s": held,
            "p_still_holds": freed is None,
            "p_snapshot": p.inspect()["requests"],
        }
    finally:
        for method in finishes:
            d.call(pd.drop_calls, _node(d, "nixl"), method, enable=False)
        d.call(pd.drop_calls, _node(d, "nixl"), "update_state_after_alloc", enable=False)


def _node(engine: EngineProcess, kind: str) -> str:
    """The path of the ``kind`` leaf (``nixl``/``disk``) in an engine's scheduler tree."""
    return next(n for n in engine.call(pd.connector_paths) if leaf_kind(n) == kind)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=["kvcompose", "multiconnector"], default="kvcompose")
    ap.add_argument(
        "--policy",
        choices=["first", "longest", "stitch"],
        default="first",
        help="D's chain policy (kvcompose only)",
    )
    ap.add_argument(
        "--observe-seed-bug",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also emulate the seed bug on D and watch P this long",
    )
    ap.add_argument(
        "--stats",
        action="store_true",
        help="MultiConnector with stats logging on (crashes, see docs/pd.md)",
    )
    args = ap.parse_args(argv)

    from kvcompose.engine.model import build_tiny_model, default_cache_dir

    model = build_tiny_model(default_cache_dir() / "tiny-llama")
    seeds = list(range(11, 20))
    t0 = time.monotonic()
    ref = dict(zip(seeds, reference(model, [prompt(s) for s in seeds]), strict=True))
    with tempfile.TemporaryDirectory(prefix="kvcompose-pd-") as tmp:
        stores = Path(tmp)
        if args.connector == "kvcompose":
            configs = kvcompose_configs(stores, args.policy)
            kw: dict[str, Any] = {}
            stats = True
        else:
            configs = multiconnector_configs(stores)
            kw = {} if args.stats else {"disable_log_stats": True}
            stats = args.stats
        t1 = time.monotonic()
        with engines(model, configs, **kw) as (p, d):
            print(f"engines started in {time.monotonic() - t1:.1f} s", flush=True)
            label = (
                f"{args.connector}/{args.policy}"
                if args.connector == "kvcompose"
                else "multiconnector"
            )
            run_all(p, d, ref, stats=stats, label=label)
            if args.observe_seed_bug:
                print(
                    f"[{label}] seed bug emulated: {observe_seed_bug(p, d, args.observe_seed_bug)}",
                    flush=True,
                )
    print(f"total {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
