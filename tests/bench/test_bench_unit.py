"""``kvcompose bench`` pieces that need no engine: workloads, chains, metrics, reports, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose.bench import chains as chainmod
from kvcompose.bench import metrics
from kvcompose.bench.workloads import (
    ChatParams,
    DocQAParams,
    MooncakeParams,
    NoReuseParams,
    WorkloadError,
    chat_workload,
    docqa_workload,
    load_trace,
    mooncake_workload,
    noreuse_workload,
    write_trace,
)

VOCAB = 1024


# --------------------------------------------------------------------------- workloads


def test_chat_tiers_hold_different_prefixes() -> None:
    p = ChatParams(users=4, new_users=1, rounds=2, prior_rounds=2, system_prompts=2,
                   system_len=256, user_len=32, answer_len=96)
    wl = chat_workload(p, vocab_size=VOCAB, seed=3)
    assert len(wl.requests) == 8
    assert [len(s) for s in wl.prefill["fast"]] == [256, 256]
    assert len(wl.prefill["disk"]) == 3  # returning users only
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals)
    for r in wl.requests:
        sys_prompt = wl.prefill["fast"][r.tags["system"]]
        assert r.prompt[:256] == sys_prompt  # the fast tier holds a short prefix of every prompt
        if r.tags["returning"]:
            hist = wl.prefill["disk"][r.tags["user"]]
            assert len(hist) == 256 + 2 * (32 + 96)
            assert r.prompt[: len(hist)] == hist  # ...and the disk tier a long one
        assert all(4 <= t < VOCAB for t in r.prompt)
    # Histories grow: round k+1 of a user extends round k's prompt.
    by_user: dict[int, list] = {}
    for r in wl.requests:
        by_user.setdefault(r.tags["user"], []).append(r)
    for reqs in by_user.values():
        a, b = sorted(reqs, key=lambda r: r.tags["round"])
        assert b.prompt[: len(a.prompt)] == a.prompt and len(b.prompt) > len(a.prompt)


def test_workloads_are_deterministic_and_seeded() -> None:
    a = chat_workload(ChatParams(users=2), vocab_size=VOCAB, seed=0)
    b = chat_workload(ChatParams(users=2), vocab_size=VOCAB, seed=0)
    c = chat_workload(ChatParams(users=2), vocab_size=VOCAB, seed=1)
    assert a.to_dict() == b.to_dict()
    assert a.requests[0].prompt != c.requests[0].prompt


def test_docqa_and_noreuse() -> None:
    wl = docqa_workload(DocQAParams(docs=2, doc_len=300, head_len=100, questions=3),
                        vocab_size=VOCAB)
    assert len(wl.requests) == 6
    for r in wl.requests:
        doc = wl.prefill["disk"][r.tags["doc"]]
        assert r.prompt[:300] == doc and wl.prefill["fast"][r.tags["doc"]] == doc[:100]
    nr = noreuse_workload(NoReuseParams(requests=5, prompt_len=64), vocab_size=VOCAB)
    assert nr.prefill == {}
    firsts = {tuple(r.prompt[:8]) for r in nr.requests}
    assert len(firsts) == 5  # nothing shared


def test_trace_round_trip_and_errors(tmp_path: Path) -> None:
    wl = chat_workload(ChatParams(users=2, rounds=1), vocab_size=VOCAB)
    path = tmp_path / "trace.jsonl"
    write_trace(wl, path)
    back = load_trace(path, vocab_size=VOCAB)
    assert [r.prompt for r in back.requests] == [r.prompt for r in wl.requests]
    assert [r.id for r in back.requests] == [r.id for r in wl.requests]
    assert back.prefill == wl.prefill
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_token_ids": [1, 2, 99999]}) + "\n")
    with pytest.raises(WorkloadError, match="vocabulary"):
        load_trace(bad, vocab_size=VOCAB)
    bad.write_text("{not json\n")
    with pytest.raises(WorkloadError, match="not JSON"):
        load_trace(bad, vocab_size=VOCAB)


def test_mooncake_keeps_sharing_structure() -> None:
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 7]},
        {"timestamp": 1500, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
    ]
    wl = mooncake_workload(rows, MooncakeParams(block_tokens=32, output_scale=0.1),
                           vocab_size=VOCAB)
    a, b, c = wl.requests
    assert len(a.prompt) == 96 and len(b.prompt) == 75 and len(c.prompt) == 38
    assert a.prompt[:64] == b.prompt[:64]  # two shared hash blocks → 64 shared tokens
    assert a.prompt[64:75] != b.prompt[64:75]
    assert a.prompt[:32] != c.prompt[:32]
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 1.5)
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (10, 4, 1)
    warm = mooncake_workload(rows, MooncakeParams(block_tokens=32, warm=1, fast_blocks=1),
                             vocab_size=VOCAB)
    assert len(warm.requests) == 2 and warm.requests[0].arrival_s == 0.0
    assert warm.prefill["disk"][0] == a.prompt and warm.prefill["fast"][0] == a.prompt[:32]


def test_mooncake_real_trace_file() -> None:
    # ../shared beside the checkout, as laid out for developers and CI
    path = (Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake-traces"
            / "conversation_trace.jsonl")
    if not path.exists():
        pytest.skip("Mooncake traces not available")
    wl = load_trace(path, vocab_size=VOCAB, limit=20, mooncake=MooncakeParams())
    assert len(wl.requests) == 20
    assert all(len(r.prompt) <= 2048 for r in wl.requests)


# --------------------------------------------------------------------------- chains


def test_parse_chains(tmp_path: Path) -> None:
    assert chainmod.parse_chain("none").kind == "none"
    assert chainmod.parse_chain("base=recompute").label == "base"
    c = chainmod.parse_chain("builtin:kvcompose-longest")
    assert c.kind == "kvcompose" and c.store_refs() == {"fast": "tmpfs", "disk": "store"}
    mc = tmp_path / "mc.json"
    mc.write_text(chainmod.BUILTIN_CHAINS["multiconnector"][2] or "")
    parsed = chainmod.parse_chain(f"upstream={mc}")
    assert (parsed.label, parsed.kind) == ("upstream", "vllm")
    with pytest.raises(chainmod.ChainError, match="no such file"):
        chainmod.parse_chain(str(tmp_path / "missing.yaml"))
    with pytest.raises(chainmod.ChainError, match="unknown built-in"):
        chainmod.parse_chain("builtin:nope")
    defs = [chainmod.parse_chain("none"), chainmod.parse_chain("recompute")]
    chainmod.unique_labels(defs)
    assert [d.label for d in defs] == ["recompute", "recompute-2"]


def test_resolve_fills_store_dirs(tmp_path: Path) -> None:
    for name in ("disk", "multiconnector", "kvcompose-first"):
        chain = chainmod.builtin_chain(name)
        res = chainmod.resolve(chain, tmp_path / "run" / name, disk_root=tmp_path / "d",
                               tmpfs_root=tmp_path / "t")
        text = json.dumps(res.kv_transfer_config)
        assert "{store:" not in text and "{tmpfs:" not in text
        assert res.stores["disk"] == str(tmp_path / "d" / name / "disk")
        stores = {leaf.store for leaf in res.store_leaves}
        assert "disk" in stores
        if name != "disk":
            assert res.stores["fast"] == str(tmp_path / "t" / name / "fast")
            assert stores == {"fast", "disk"}
            fast = next(leaf for leaf in res.store_leaves if leaf.store == "fast")
            prep = fast.prep_config("/x")
            # the fast tier is read-only in the chain, but its preparation writes it
            assert prep["kv_connector_extra_config"] == {"path": "/x"}
    first = chainmod.resolve(chainmod.builtin_chain("kvcompose-first"), tmp_path / "a",
                             disk_root=tmp_path / "d", tmpfs_root=tmp_path / "t")
    multi = chainmod.resolve(chainmod.builtin_chain("multiconnector"), tmp_path / "b",
                             disk_root=tmp_path / "d", tmpfs_root=tmp_path / "t")
    # Chains that store the same way share one prepared copy of each store.
    assert ({(leaf.store, leaf.variant()) for leaf in first.store_leaves}
            == {(leaf.store, leaf.variant()) for leaf in multi.store_leaves})
    assert first.kv_transfer_config["kv_connector"] == "KVCompose"
    assert multi.kv_transfer_config["kv_connector"] == "MultiConnector"


def test_resolve_reports_bad_kvcompose_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nkv_role: kv_both\ntree:\n  chain:\n    policy: sideways\n"
                   "    children: []\n")
    chain = chainmod.parse_chain(str(bad))
    with pytest.raises(chainmod.ChainError, match="bad"):
        chainmod.resolve(chain, tmp_path / "run", disk_root=tmp_path, tmpfs_root=tmp_path)


# --------------------------------------------------------------------------- metrics


def test_percentiles_and_agreement() -> None:
    assert metrics.percentile([], 50) is None
    assert metrics.percentile([3.0], 99) == 3.0
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile(list(range(101)), 90) == pytest.approx(90.0)
    rec = {"id": "a", "arrival_s": 1.0, "first_token_s": 1.5, "finish_s": 2.5,
           "output_token_ids": [1, 2, 3], "prompt_tokens": 10}
    lat = metrics.request_latencies(rec)
    assert lat == {"ttft_s": 0.5, "tpot_s": 0.5, "e2e_s": 1.5}
    ref = [{"id": "a", "output_token_ids": [1, 2, 3]}, {"id": "b", "output_token_ids": [4]}]
    got = [{"id": "a", "output_token_ids": [1, 2, 3]}, {"id": "b", "output_token_ids": [5]}]
    agree = metrics.agreement(got, ref)
    assert agree["percent"] == 50.0 and agree["mismatched"] == ["b"]
    thr = metrics.throughput([rec])
    assert thr["requests_per_s"] == pytest.approx(1 / 1.5, rel=1e-3)


def test_report_rows_and_tables() -> None:
    from kvcompose.bench import report

    results = {
        "meta": {"workload": {"name": "chat", "requests": 1}},
        "chains": [
            {"label": "recompute", "status": "ok", "kind": "none",
             "latency": {"ttft_p50_s": 1.0, "requests": 1, "finished": 1},
             "throughput": {"requests_per_s": 1.0}, "hits": {"stores": {}, "nodes": {},
                                                             "tokens_loaded": 0,
                                                             "bytes_written": 0},
             "agreement": {"percent": 100.0}, "requests": [{"id": "a", "ttft_s": 1.0}]},
            {"label": "broken", "status": "failed", "error": "boom"},
        ],
        "goals": {"failed_chains": ["broken"]},
    }
    rows = report.chain_rows(results)
    assert rows[0]["chain"] == "recompute" and rows[1]["error"] == "boom"
    assert "requests" not in report.slim(results)["chains"][0]
    assert len(report.tables(results)) == 2
    assert report.goals_lines(results) == ["failed chains: broken"]


# --------------------------------------------------------------------------- CLI


def test_cli_options() -> None:
    import argparse

    from kvcompose.cli import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    opts = bench_cmd.options_from_args(parser.parse_args([]))
    assert opts.model == "builtin" and opts.chains == [] and opts.workload == "chat"
    assert not opts.engine.enable_prefix_caching
    quick = bench_cmd.options_from_args(parser.parse_args(
        ["--quick", "-c", "none", "-c", "builtin:disk", "--seeds", "1,2", "--prefix-caching"]))
    assert quick.model == "tiny" and quick.seeds == [1, 2] and quick.chat.users == 3
    assert quick.engine.enable_prefix_caching


def test_bench_is_a_kvcompose_subcommand() -> None:
    from kvcompose.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--list-chains"])
    assert args.list_chains and callable(args.func)
