"""``kvcompose bench`` pieces that need no engine: workloads, contenders, metrics, reports,
CLI, goals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose.bench import contenders as cmod
from kvcompose.bench import metrics
from kvcompose.bench.resolve import resolve
from kvcompose.bench.traces import MooncakeParams, load_trace, mooncake_workload, write_trace
from kvcompose.bench.workloads import (
    ChatParams,
    DocQAParams,
    NoReuseParams,
    WorkloadError,
    chat_workload,
    docqa_workload,
    noreuse_workload,
)

VOCAB = 1024


# --------------------------------------------------------------------------- workloads


def test_chat_tiers_hold_different_prefixes() -> None:
    p = ChatParams(
        users=4,
        new_users=1,
        rounds=2,
        prior_rounds=2,
        system_prompts=2,
        system_len=256,
        user_len=32,
        answer_len=96,
    )
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
    wl = docqa_workload(
        DocQAParams(docs=2, doc_len=300, head_len=100, questions=3), vocab_size=VOCAB
    )
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


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"prompt_token_ids": [1, 2], "arrival_s": "soon"}', r":1: arrival_s: Input should be"),
        ('{"prompt_token_ids": [1, 2], "arrival_s": NaN}', r":1: arrival_s: .*finite"),
        ('{"prompt_token_ids": [1, 2], "arrival_s": -1}', r":1: arrival_s: .*greater than"),
        ('{"prompt_token_ids": [1, 2], "max_tokens": null}', r":1: max_tokens: "),
        ('{"prompt_token_ids": [1, 2], "max_tokens": -4}', r":1: max_tokens: .*greater than"),
        ('{"prompt_token_ids": [1, true]}', r":1: prompt_token_ids.1: "),
        ('{"prompt_token_ids": [1, -2]}', r":1: prompt_token_ids.1: .*greater than"),
        ('{"prompt_token_ids": []}', r":1: prompt_token_ids: .*at least 1"),
        ('{"prompt_token_ids": [1], "prefill": 3}', r":1: prefill: "),
        (
            '\n\n{"prompt_token_ids": [1]}\n{"arrival_s": 1}',
            r":4: prompt_token_ids: Field required",
        ),
        ('{"hash_ids": [1, 2], "input_length": 100}', r":1: timestamp: Field required"),
        ('{"hash_ids": "abc", "input_length": 100, "timestamp": 0}', r":1: hash_ids: "),
        ('{"hash_ids": [1], "input_length": "100", "timestamp": 0}', r":1: input_length: "),
        ("[" * 100_000, r":1: not JSON"),
        (b'{"prompt_token_ids": [1]}\n\xff\xfe', r":2: not UTF-8 text"),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_line_and_field(
    tmp_path: Path, lines: str | bytes, message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(lines if isinstance(lines, bytes) else lines.encode())
    with pytest.raises(WorkloadError, match=message):
        load_trace(bad, vocab_size=VOCAB)


def test_mooncake_keeps_sharing_structure() -> None:
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1200, "output_length": 40, "hash_ids": [0, 1, 7]},
        {"timestamp": 1500, "input_length": 600, "output_length": 10, "hash_ids": [5, 6]},
    ]
    wl = mooncake_workload(
        rows, MooncakeParams(block_tokens=32, output_scale=0.1), vocab_size=VOCAB
    )
    a, b, c = wl.requests
    assert len(a.prompt) == 96 and len(b.prompt) == 75 and len(c.prompt) == 38
    assert a.prompt[:64] == b.prompt[:64]  # two shared hash blocks → 64 shared tokens
    assert a.prompt[64:75] != b.prompt[64:75]
    assert a.prompt[:32] != c.prompt[:32]
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 1.5)
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (10, 4, 1)
    warm = mooncake_workload(
        rows, MooncakeParams(block_tokens=32, warm=1, fast_blocks=1), vocab_size=VOCAB
    )
    assert len(warm.requests) == 2 and warm.requests[0].arrival_s == 0.0
    assert warm.prefill["disk"][0] == a.prompt and warm.prefill["fast"][0] == a.prompt[:32]


def test_mooncake_real_trace_file() -> None:
    # ../shared beside the checkout, as laid out for developers and CI
    path = (
        Path(__file__).resolve().parents[3]
        / "shared"
        / "data"
        / "mooncake-traces"
        / "conversation_trace.jsonl"
    )
    if not path.exists():
        pytest.skip("Mooncake traces not available")
    wl = load_trace(path, vocab_size=VOCAB, limit=20, mooncake=MooncakeParams())
    assert len(wl.requests) == 20
    assert all(len(r.prompt) <= 2048 for r in wl.requests)


# --------------------------------------------------------------------------- contenders


def test_parse_contenders(tmp_path: Path) -> None:
    assert cmod.parse_contender("none").kind == "none"
    assert cmod.parse_contender("base=recompute").label == "base"
    c = cmod.parse_contender("builtin:kvcompose-longest")
    assert c.kind == "kvcompose" and c.store_refs() == {"fast": "tmpfs", "disk": "store"}
    mc = tmp_path / "mc.json"
    mc.write_text(cmod.BUILTIN_CONTENDERS["multiconnector"][2] or "")
    parsed = cmod.parse_contender(f"upstream={mc}")
    assert (parsed.label, parsed.kind) == ("upstream", "vllm")
    with pytest.raises(cmod.ContenderError, match="no such file"):
        cmod.parse_contender(str(tmp_path / "missing.yaml"))
    with pytest.raises(cmod.ContenderError, match="unknown built-in"):
        cmod.parse_contender("builtin:nope")
    defs = [cmod.parse_contender("none"), cmod.parse_contender("recompute")]
    cmod.unique_labels(defs)
    assert [d.label for d in defs] == ["recompute", "recompute-2"]


def test_a_contender_file_name_makes_a_safe_label(tmp_path: Path) -> None:
    """A label names directories and table rows: a file name's other characters go."""
    odd = tmp_path / "[bold]my tiers:x:.yaml"
    odd.write_text("version: 1\n")
    assert cmod.parse_contender(str(odd)).label == "bold-my-tiers-x-"
    assert cmod.safe_label("../..") == "contender"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(cmod.ContenderError, match="not UTF-8 text"):
        cmod.parse_contender(str(binary))


def test_resolve_fills_store_dirs(tmp_path: Path) -> None:
    for name in ("disk", "multiconnector", "kvcompose-first"):
        contender = cmod.builtin_contender(name)
        res = resolve(
            contender, tmp_path / "run" / name, disk_root=tmp_path / "d", tmpfs_root=tmp_path / "t"
        )
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
            # the fast tier is read-only in the contender, but its preparation writes it
            assert prep["kv_connector_extra_config"] == {"path": "/x"}
    first = resolve(
        cmod.builtin_contender("kvcompose-first"),
        tmp_path / "a",
        disk_root=tmp_path / "d",
        tmpfs_root=tmp_path / "t",
    )
    multi = resolve(
        cmod.builtin_contender("multiconnector"),
        tmp_path / "b",
        disk_root=tmp_path / "d",
        tmpfs_root=tmp_path / "t",
    )
    # Contenders that store the same way share one prepared copy of each store.
    assert {(leaf.store, leaf.variant()) for leaf in first.store_leaves} == {
        (leaf.store, leaf.variant()) for leaf in multi.store_leaves
    }
    # hma: auto, and every leaf (the store) supports HMA: the entry that keeps it on, read
    # from vLLM where it is installed
    from kvcompose.config import vllm_available

    hma = "KVComposeHMA" if vllm_available() else "KVCompose"
    assert first.kv_transfer_config["kv_connector"] == hma
    assert multi.kv_transfer_config["kv_connector"] == "MultiConnector"


def test_resolve_reports_bad_kvcompose_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nkv_role: kv_both\ntree:\n  chain:\n    policy: sideways\n    children: []\n"
    )
    contender = cmod.parse_contender(str(bad))
    with pytest.raises(cmod.ContenderError, match="bad"):
        resolve(contender, tmp_path / "run", disk_root=tmp_path, tmpfs_root=tmp_path)


# --------------------------------------------------------------------------- metrics


def test_percentiles_and_agreement() -> None:
    from kvcompose.bench.results import RequestRecord

    assert metrics.percentile([], 50) is None
    assert metrics.percentile([3.0], 99) == 3.0
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5
    assert metrics.percentile(list(range(101)), 90) == pytest.approx(90.0)
    assert metrics.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    rec = RequestRecord(
        id="a",
        arrival_s=1.0,
        added_s=1.0,
        first_token_s=1.5,
        finish_s=2.5,
        output_token_ids=[1, 2, 3],
        prompt_tokens=10,
    )
    assert metrics.request_latencies(rec) == (0.5, 0.5, 1.5)

    def out(rid: str, ids: list[int]) -> RequestRecord:
        return RequestRecord(id=rid, arrival_s=0, added_s=0, prompt_tokens=1, output_token_ids=ids)

    ref = [out("a", [1, 2, 3]), out("b", [4])]
    got = [out("a", [1, 2, 3]), out("b", [5])]
    agree = metrics.agreement(got, ref, "recompute")
    assert agree.percent == 50.0 and agree.mismatched == ["b"]
    assert agree.reference == "recompute"
    thr = metrics.throughput([rec])
    assert thr.requests_per_s == pytest.approx(1 / 1.5, rel=1e-3)


def _results(tmp_path: Path):
    from kvcompose.bench.results import (
        Agreement,
        BenchResults,
        ContenderResult,
        HitSummary,
        KVCacheFacts,
        LatencySummary,
        Meta,
        RequestRow,
        Throughput,
    )

    return BenchResults(
        meta=Meta(
            started="now",
            python="3.11",
            workload={"name": "chat", "requests": 1},
            out_dir=str(tmp_path),
        ),
        contenders=[
            ContenderResult(
                label="recompute",
                source="none",
                kind="none",
                status="ok",
                latency=LatencySummary(ttft_p50_s=1.0, requests=1, finished=1),
                throughput=Throughput(requests_per_s=1.0),
                hits=HitSummary(),
                agreement=Agreement(percent=100.0),
                kv_cache=KVCacheFacts(
                    num_blocks=640, groups=["SlidingWindowSpec", "FullAttentionSpec"], hma=True
                ),
                preemptions=0.0,
                requests=[
                    RequestRow(
                        id="a",
                        seed=0,
                        prompt_tokens=3,
                        cached_tokens=0,
                        output_tokens=2,
                        ttft_s=1.0,
                        tpot_s=None,
                        e2e_s=1.2,
                        arrival_s=0.0,
                    )
                ],
            ),
            ContenderResult(
                label="broken", source="x.json", kind="vllm", status="failed", error="boom"
            ),
        ],
    )


def test_report_rows_tables_and_files(tmp_path: Path) -> None:
    import csv

    from kvcompose.bench import report
    from kvcompose.bench.results import BenchResults

    results = _results(tmp_path)
    rows = report.contender_rows(results)
    assert rows[0]["contender"] == "recompute" and rows[1]["error"] == "boom"
    # the KV cache vLLM set up, as measured in the engine: a column each
    assert (rows[0]["kv_blocks"], rows[0]["kv_groups"], rows[0]["hma"]) == (640, 2, True)
    assert rows[0]["preemptions"] == 0.0 and rows[1]["kv_blocks"] is None
    main = report.tables(results)[0]
    cells = {col.header: list(col.cells) for col in main.columns}
    assert cells["KV blocks"] == ["640 (2 groups)", "-"] and cells["HMA"] == ["on", "-"]
    report.write_all(results, tmp_path, plots=False)
    back = BenchResults.model_validate_json((tmp_path / "results.json").read_text())
    assert [c.label for c in back.contenders] == ["recompute", "broken"]
    assert (
        "requests" not in json.loads((tmp_path / "results.json").read_text())["contenders"][0]
    )  # per-request rows go to requests.csv
    with open(tmp_path / "requests.csv", newline="") as fh:
        req = list(csv.DictReader(fh))
    assert [(r["contender"], r["id"], r["ttft_s"]) for r in req] == [("recompute", "a", "1.0")]
    again = report.read_results(tmp_path)  # results.json + requests.csv
    assert again.contender("recompute").requests == results.contender("recompute").requests
    with open(tmp_path / "results.csv", newline="") as fh:
        assert [r["contender"] for r in csv.DictReader(fh)] == ["recompute", "broken"]


def test_tables_show_markup_in_labels_and_errors_as_text(tmp_path: Path) -> None:
    """A label or an engine's error with ``[/x]`` or ``list[int]`` is printed as is (rich
    read it as markup: it dropped ``[int]`` and raised on a closing tag)."""
    from rich.console import Console

    from kvcompose.bench import report

    results = _results(tmp_path)
    results.contenders[1].label = "b[/x]list[int]"
    con = Console(width=300, record=True, emoji=False)
    for table in report.tables(results):
        con.print(table)
    assert "b[/x]list[int]" in con.export_text()


def test_goals_of_the_default_comparison(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_goals", Path(__file__).resolve().parents[2] / "benchmarks" / "goals.py"
    )
    assert spec is not None and spec.loader is not None
    goals = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(goals)
    results = _results(tmp_path)
    measured = goals.goals(results)
    assert measured["failed_contenders"] == ["broken"]
    assert measured["output_agreement_percent"]["met"] is True
    assert goals.lines(measured)[-1] == "failed contenders: broken"


# --------------------------------------------------------------------------- CLI


def test_cli_options() -> None:
    import argparse

    from kvcompose.cli import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    opts = bench_cmd.options_from_args(parser.parse_args([]))
    assert opts.model == "builtin" and opts.contenders == [] and opts.workload == "chat"
    assert not opts.engine.enable_prefix_caching and opts.seeds == [0]
    assert (opts.chat.users, opts.engine.max_model_len, opts.contender_timeout_s) == (
        5,
        4096,
        1800.0,
    )
    assert opts.prefill and opts.plots and opts.progress and not opts.keep_stores
    assert opts.repeats == 3
    quick = bench_cmd.options_from_args(
        parser.parse_args(
            [
                "--quick",
                "-c",
                "none",
                "--chain",
                "builtin:disk",
                "--seeds",
                "1,2",
                "--prefix-caching",
            ]
        )
    )
    assert quick.model == "tiny" and quick.seeds == [1, 2] and quick.chat.users == 3
    assert quick.contenders == ["none", "builtin:disk"]
    assert quick.engine.enable_prefix_caching
    assert quick.repeats == 1
    flags = bench_cmd.options_from_args(
        parser.parse_args(
            [
                "--users",
                "5",
                "--interval",
                "0.5",
                "--no-prefill",
                "--no-plots",
                "--no-progress",
                "--chain-timeout",
                "60",
                "--out",
                "x",
                "--mooncake-warm",
                "3",
                "--warmup",
                "0",
                "--store-dir",
                "s",
                "--max-tokens",
                "7",
                "--block-size",
                "16",
            ]
        )
    )
    assert (flags.chat.users, flags.chat.interval_s, flags.noreuse.interval_s) == (5, 0.5, 0.5)
    assert not (flags.prefill or flags.plots or flags.progress)
    assert (flags.contender_timeout_s, flags.out_dir, flags.mooncake.warm) == (60.0, "x", 3)
    assert (flags.warmup_requests, flags.store_root, flags.max_tokens) == (0, "s", 7)
    assert flags.engine.block_size == 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats: must be at least 1, got '0'"),
        (["--time-scale", "nan"], "--time-scale: expected a finite number, got 'nan'"),
        (["--time-scale", "-1"], "--time-scale: must be at least 0"),
        (["--interval", "inf"], "--interval: expected a finite number"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
        (["--trace-limit", "-3"], "--trace-limit: must be at least 1"),
        (["--seeds", ",,"], "--seeds: expected comma-separated integers, got ',,'"),
        (["--seeds", "1,-2"], "--seeds: expected comma-separated integers of at least 0"),
        (["--users", "0"], "--users: must be at least 1"),
        (["--max-num-seqs", "x"], "--max-num-seqs: expected an integer, got 'x'"),
        (["--dtype", "fp8ish"], "--dtype: invalid choice: 'fp8ish'"),
        (["--mooncake-block-tokens", "0"], "--mooncake-block-tokens: must be at least 1"),
    ],
)
def test_bad_numbers_are_usage_errors_before_any_engine(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcompose.cli.main import main

    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--out", "--store-dir", "--tmpfs-dir"])
def test_a_directory_that_cannot_be_made_is_refused_first(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcompose.cli.main import main

    a_file = tmp_path / "results"
    a_file.write_text("")
    argv = ["bench", "-w", "noreuse", "-c", "none", "--out", str(tmp_path / "out")]
    assert main([*argv, flag, str(a_file), "--model", str(tmp_path / "no-model")]) == 1
    # Refused before the model is looked at (and before any engine).
    assert capsys.readouterr().err == f"kvcompose bench: {flag} {a_file}: not a directory\n"


@pytest.mark.parametrize(
    ("config_json", "message"),
    [
        (None, "not a model directory (no config.json)"),
        (b'{"architectures": 5', "config.json: cannot be read as JSON (Expecting"),
        (b"\xff\xfe\x00", "config.json: cannot be read as JSON"),
        (b"[1, 2]", "config.json: not a model config (a JSON object)"),
        (b'{"text_config": 3}', "config.json: not a model config (a JSON object)"),
        (b'{"vocab_size": "big"}', "config.json: vocab_size must be a positive integer, not 'big'"),
        (b'{"vocab_size": 0}', "config.json: vocab_size must be a positive integer, not 0"),
    ],
)
def test_a_model_directory_that_is_no_model_is_refused_first(
    tmp_path: Path, config_json: bytes | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcompose.cli.main import main

    model = tmp_path / "model"
    model.mkdir()
    if config_json is not None:
        (model / "config.json").write_bytes(config_json)
    argv = ["bench", "-w", "noreuse", "-c", "none", "--out", str(tmp_path / "out")]
    assert main([*argv, "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err, err


def test_contenders_that_cannot_run_are_refused_before_any_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcompose.cli.main import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nkv_role: kv_both\ntree:\n  chain: {name: c, children: []}\n")
    out = tmp_path / "out"
    argv = ["bench", "-w", "noreuse", "-c", "none", "-c", "typo", "-c", f"x={bad}"]
    assert main([*argv, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "contender 'typo': no such file" in err
    # The user's file and line, not the copy with the store directories filled in.
    assert f"contender 'x': {bad}:4: tree.chain.children:" in err
    # A device or a directory is no contender file (reading /dev/zero would never end).
    for spec, why in (("/dev/zero", "not a regular file"), (str(tmp_path), "not a regular file")):
        assert main(["bench", "-w", "noreuse", "-c", spec, "--out", str(out)]) == 1
        assert f"contender {spec!r}: {why}" in capsys.readouterr().err
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (3 << 20))
    assert main(["bench", "-w", "noreuse", "-c", str(big), "--out", str(out)]) == 1
    assert "too large for a config file" in capsys.readouterr().err
    assert not (out / "runs" / "recompute").exists()  # no engine started


def test_bench_is_a_kvcompose_subcommand() -> None:
    from kvcompose.cli.main import build_parser

    for flag in ("--list-contenders", "--list-chains"):
        args = build_parser().parse_args(["bench", flag])
        assert args.list_contenders and callable(args.func)


# --------------------------------------------------------------------------- rounds


def _run(label: str, seed: int, rnd: int, ttfts: list[float]):
    from kvcompose.bench.results import RequestRecord, RunResult

    reqs = [
        RequestRecord(
            id=f"r{i}",
            arrival_s=float(i),
            added_s=float(i),
            first_token_s=i + t,
            finish_s=i + t + 0.1,
            prompt_tokens=8,
            output_token_ids=[1, 2],
        )
        for i, t in enumerate(ttfts)
    ]
    return RunResult(ok=True, label=label, seed=seed, round=rnd, requests=reqs)


def test_round_order_rotates() -> None:
    from kvcompose.bench.run import round_order

    assert [round_order(list("ABC"), r) for r in range(4)] == [
        list("ABC"),
        list("BCA"),
        list("CAB"),
        list("ABC"),
    ]
    assert round_order([], 1) == []


def test_ratios_are_taken_within_rounds_and_overlaps_reported() -> None:
    from kvcompose.bench.summary import Contender, summarise

    # TTFT p50 per round: recompute 1.0 / 1.2 / 0.9 s (a slow spell in round 2).
    p50 = {
        "recompute": [1.0, 1.2, 0.9],
        "disk": [0.2, 0.2, 0.15],
        "longest": [0.19, 0.25, 0.15],
        "first": [0.5, 0.6, 0.45],
    }
    contenders = []
    for label, per_round in p50.items():
        c = Contender(
            definition=cmod.parse_contender(
                "none" if label == "recompute" else f"{label}=builtin:disk"
            )
        )
        # three requests per run: the p50 is the middle one
        c.runs = [_run(label, 0, r, [t / 2, t, t * 2]) for r, t in enumerate(per_round)]
        contenders.append(c)
    out = {e.label: e for e in summarise(contenders, several_runs=True)}
    assert out["disk"].speedup_rounds == [5.0, 6.0, 6.0]
    assert out["disk"].ttft_p50_speedup == 6.0
    assert (out["disk"].speedup_low, out["disk"].speedup_high) == (5.0, 6.0)
    assert out["longest"].speedup_rounds == [5.263, 4.8, 6.0]
    assert out["first"].speedup_rounds == [2.0, 2.0, 2.0]
    assert out["recompute"].ttft_p50_speedup == 1.0
    assert out["longest"].ttft_p50_rounds == [0.19, 0.25, 0.15]
    # TTFT p50 ranges: disk 0.15-0.2 and longest 0.15-0.25 overlap (the same work): within
    # noise of each other; first (0.45-0.6) and recompute (0.9-1.2) are not.
    assert out["disk"].within_noise_of == ["longest"]
    assert out["longest"].within_noise_of == ["disk"]
    assert out["first"].within_noise_of == []
    assert out["recompute"].within_noise_of == []
    # request ids are per seed and round, the agreement compares same-round runs
    assert out["disk"].agreement.compared == 9 and out["disk"].agreement.percent == 100.0
    # one round: no spread, no claim about noise
    single = summarise(
        [Contender(definition=c.definition, runs=c.runs[:1]) for c in contenders],
        several_runs=False,
    )
    assert all(e.within_noise_of is None for e in single)
    assert single[1].ttft_p50_speedup == 5.0


def test_hits_are_per_replay() -> None:
    from kvcompose.bench import metrics
    from kvcompose.bench.results import ConnectorSnapshot

    runs = []
    for seed, rnd in ((0, 0), (0, 1), (1, 0), (1, 1)):
        run = _run("x", seed, rnd, [0.1])
        run.connector = ConnectorSnapshot(stores={"disk": {"tokens_loaded": 100 + seed * 10}})
        runs.append(run)
    hits = metrics.per_replay_hits(runs)
    assert hits.stores["disk"].tokens_loaded == 210  # 100 (seed 0) + 110 (seed 1)
    assert hits.tokens_loaded == 210


def test_round_ratios_median_stays_within_their_range() -> None:
    """With two rounds the median is a mean of two 3-decimal ratios: it is kept at the same
    precision, so the reported median never falls outside [min, max] (it once read 0.81
    against a low of 0.814)."""
    from kvcompose.bench.results import ContenderResult, RequestRow
    from kvcompose.bench.summary import compare_rounds

    def contender(label: str, ttfts: list[float]) -> ContenderResult:
        rows = [
            RequestRow(id=f"r{i}", seed=0, round=i, prompt_tokens=1, cached_tokens=0,
                       output_tokens=1, ttft_s=t, tpot_s=None, e2e_s=None, arrival_s=0.0)
            for i, t in enumerate(ttfts)
        ]  # fmt: skip
        return ContenderResult(label=label, source=label, kind="none", requests=rows)

    ref = contender("recompute", [0.814, 0.815])
    tiers = contender("tiers", [1.0, 1.0])
    compare_rounds([ref, tiers], "recompute")
    assert tiers.speedup_rounds == [0.814, 0.815]
    assert tiers.speedup_low <= tiers.ttft_p50_speedup <= tiers.speedup_high


def test_paired_ratios_pair_rounds_by_key_or_position() -> None:
    """The benchmark scripts (one_child, stitch_emulated) and the bench's own ratios to
    recompute share one pairing: by round where rounds are known, a round one side lacks
    skipped; by position for the lists of results.json, which must be as long as each other."""
    from kvcompose.bench.summary import paired_ratios

    keyed = paired_ratios({(0, 0): 0.3, (0, 1): 0.2, (0, 2): 0.5}, {(0, 0): 0.1, (0, 2): 0.25})
    assert keyed.ratios == pytest.approx([3.0, 2.0])
    listed = paired_ratios([0.3, 0.2, 0.5], [0.1, 0.4, 0.25])
    assert listed.ratios == pytest.approx([3.0, 0.5, 2.0])
    assert (listed.low, listed.median, listed.high) == pytest.approx((0.5, 2.0, 3.0))
    with pytest.raises(ValueError, match="3 rounds against 2"):
        paired_ratios([0.3, 0.2, 0.5], [0.1, 0.4])
