"""The ``kvcompose`` command line: every subcommand, exit codes, and never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from config_helpers import EXAMPLES, ROOT, needs_vllm

from kvcompose.cli import main as cli_main
from kvcompose.config import json_schema, load_config, tree_from_extra_config

TIERS = EXAMPLES / "two-disk-tiers.yaml"


def test_help_lists_the_commands(run_cli) -> None:
    code, out, _ = run_cli("--help")
    assert code == 0
    for command in ("validate", "explain", "vllm-args", "convert", "schema", "bench", "proxy"):
        assert command in out


def test_no_command_prints_help(run_cli) -> None:
    code, _, err = run_cli()
    assert code == 2 and "usage:" in err


def test_a_command_that_cannot_be_imported_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every command ships with the package: one that cannot be imported is a bug, never a
    command silently missing from --help (``bench`` once was, behind an OPTIONAL set)."""
    monkeypatch.setattr(cli_main, "COMMANDS", ("validate", "nosuch"))
    with pytest.raises(ImportError):
        cli_main.load_commands()


def test_validate_ok_and_bad(run_cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tree:\n  leaf: {conector: A}\n")
    code, out, err = run_cli("validate", "--offline", str(TIERS), str(bad))
    assert code == 1
    assert out == f"{TIERS}: ok (3 nodes, 2 leaves; vLLM not checked)\n"
    assert err == (
        f"{bad}:2: tree.leaf.conector: unknown key 'conector' (did you mean 'connector'?)\n"
    )
    code, out, err = run_cli("validate", "--offline", "-q", str(TIERS))
    assert (code, out, err) == (0, "", "")


def test_validate_all_errors_and_strict(run_cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tree:\n  leaf: {connector: A, save: 1, on_error: x}\n")
    code, _, err = run_cli("validate", "--offline", "--all-errors", str(bad))
    assert code == 1 and len(err.splitlines()) == 2
    warn = tmp_path / "warn.yaml"
    warn.write_text("tree:\n  chain:\n    children: [{leaf: {connector: A}}]\n")
    code, _, err = run_cli("validate", "--offline", str(warn))
    assert code == 0 and "warning: tree.chain: chain 'chain' has a single child" in err
    code, _, _ = run_cli("validate", "--offline", "--strict", str(warn))
    assert code == 1


def test_validate_applies_env_and_set(run_cli) -> None:
    code, _, err = run_cli(
        "validate", "--offline", str(TIERS), env={"KVCOMPOSE_SET": "nvme.save=maybe"}
    )
    assert code == 1 and err.startswith("KVCOMPOSE_SET 'nvme.save=maybe': ")
    code, _, _ = run_cli(
        "validate", "--offline", "--no-env", str(TIERS), env={"KVCOMPOSE_SET": "nvme.save=maybe"}
    )
    assert code == 0
    code, _, err = run_cli("validate", "--offline", str(TIERS), "--set", "tiers.policy=best")
    assert code == 1 and err.startswith("--set 'tiers.policy=best': tree.chain.policy: must be")


@pytest.mark.parametrize(
    "args",
    [
        ["validate", "/no/such/file.yaml"],
        ["explain", "/no/such/file.yaml"],
        ["vllm-args", "/no/such/file.yaml"],
        ["convert", "/no/such/file.yaml"],
        ["validate", "--bogus-flag", "x"],
        ["frobnicate"],
    ],
)
def test_never_a_traceback(run_cli, args: list[str]) -> None:
    code, _, err = run_cli(*args)
    assert code in (1, 2)
    assert "Traceback" not in err
    assert err.strip()


def test_never_a_traceback_on_odd_files(run_cli, tmp_path: Path) -> None:
    binary = tmp_path / "x.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("tree:\n\tleaf: {connector: A}\n")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    for path in (binary, tabs, deep, tmp_path):
        code, _, err = run_cli("validate", "--offline", str(path))
        assert code == 1, path
        assert "Traceback" not in err and len(err.splitlines()) == 1, err


def test_internal_errors_are_one_line(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose.cli import validate_cmd

    def boom(args: object) -> int:
        raise RuntimeError("kaput")

    monkeypatch.setattr(validate_cmd, "run", boom)
    code, _, err = run_cli("validate", str(TIERS))
    assert code == 3
    assert err == (
        "kvcompose: internal error: RuntimeError: kaput (set KVCOMPOSE_DEBUG=1 for the traceback)\n"
    )


def test_a_command_stopped_by_sigterm_says_so(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench turns SIGTERM into ``SystemExit(143)`` to clean up; that is no internal
    error, and the status stays the shell's for SIGTERM."""
    from kvcompose.cli import validate_cmd

    def stopped(args: object) -> int:
        raise SystemExit(143)

    monkeypatch.setattr(validate_cmd, "run", stopped)
    code, _, err = run_cli("validate", str(TIERS))
    assert (code, err) == (143, "kvcompose: stopped by SIGTERM\n")


def test_explain_offline(run_cli) -> None:
    code, out, err = run_cli("explain", "--offline", str(EXAMPLES / "route-by-params.yaml"))
    assert code == 0, err
    assert "by-params  route: one child per request looks up and loads" in out
    assert "rule 1: kv_transfer_params['do_remote_prefill'] == True → nixl" in out
    assert "default → cache  chain, policy longest" in out
    assert "#1 ram  leaf ExampleConnector  saves" in out
    assert "kv_transfer_params: produced by nixl (NixlConnector)" in out
    assert "HMA: unknown without vLLM" in out


@needs_vllm
def test_explain_with_vllm(run_cli) -> None:
    code, out, _ = run_cli("explain", str(EXAMPLES / "pd-disk-tier.yaml"))
    assert code == 0
    assert "pd  chain, policy longest: asks every child; the longest hit loads" in out
    assert "class NixlPullConnector, HMA yes" in out
    assert "HMA: off: not supported by disk" in out
    assert "KV cache layout: LBHNC for non-MLA models (required by nixl)" in out
    assert "CUDA graphs: no piecewise requirement" in out


def test_explain_marks_non_saving_leaves(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "kv_role: kv_both\ntree:\n  fanout:\n    load_from: a\n    save: false\n"
        "    children:\n      - leaf: {name: a, connector: A}\n"
        "      - leaf: {name: b, connector: B, save: false}\n"
    )
    code, out, _ = run_cli("explain", "--offline", str(path))
    assert code == 0
    assert "loads a  leaf A  no save (an ancestor has save: false)" in out
    assert "b  leaf B  no save" in out
    assert "warning: no leaf saves" in out


def test_vllm_args_json_round_trips(run_cli) -> None:
    for example in sorted(EXAMPLES.glob("*.yaml")):
        code, out, err = run_cli("vllm-args", "--offline", "--json", str(example))
        assert code == 0, err
        data = json.loads(out)
        assert data["kv_connector"] == "KVCompose"
        assert data["kv_connector_module_path"] == "kvcompose"
        config = load_config(str(example), env={}, check_vllm=False)
        assert data["kv_role"] == config.transfer["kv_role"]  # D's example: kv_consumer
        tree = tree_from_extra_config(data["kv_connector_extra_config"], env={}, check_vllm=False)
        # the same tree once the top-level fields are inherited from the vLLM config
        from kvcompose.config import child_transfer_config
        from kvcompose.tree import leaves

        parent = {k: v for k, v in data.items() if k != "kv_connector_extra_config"}
        assert [child_transfer_config(parent, leaf) for leaf in leaves(tree)] == [
            child_transfer_config(parent, leaf) for leaf in leaves(config.tree)
        ]
        assert [leaf.name for leaf in leaves(tree)] == [leaf.name for leaf in leaves(config.tree)]


def test_vllm_args_output_is_loadable_by_kvcompose(run_cli, tmp_path: Path) -> None:
    code, out, _ = run_cli("vllm-args", "--offline", "--json", str(TIERS))
    assert code == 0
    args_file = tmp_path / "args.json"
    args_file.write_text(out)
    config = load_config(str(args_file), env={}, check_vllm=False)
    assert config.origin == "kvcompose-args"
    assert config.tree == load_config(str(TIERS), env={}, check_vllm=False).tree


def test_vllm_args_by_path(run_cli, tmp_path: Path) -> None:
    code, out, _ = run_cli(
        "vllm-args", "--offline", "--json", "--by-path", str(TIERS), "--set", "nvme.save=false"
    )
    assert code == 0
    extra = json.loads(out)["kv_connector_extra_config"]
    assert extra == {"config": str(TIERS.resolve()), "set": {"nvme.save": False}}
    tree = tree_from_extra_config(extra, env={}, check_vllm=False)
    assert tree.children[0].save is False


def test_vllm_args_default_output_and_python(run_cli) -> None:
    code, out, _ = run_cli("vllm-args", "--offline", str(TIERS))
    assert code == 0
    assert '--kv-transfer-config \'{"kv_connector":"KVCompose"' in out
    assert "kv_transfer_config = KVTransferConfig(" in out
    code, out, _ = run_cli("vllm-args", "--offline", "--python", "--no-module-path", str(TIERS))
    namespace: dict = {}
    source = out.replace("from vllm.config import KVTransferConfig", "KVTransferConfig = dict")
    exec(compile(source, "<vllm-args>", "exec"), namespace)
    built = namespace["kv_transfer_config"]
    assert built["kv_connector"] == "KVCompose" and "kv_connector_module_path" not in built
    assert built["kv_connector_extra_config"]["tree"]["chain"]["name"] == "tiers"


def test_vllm_args_needs_kv_role(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("tree:\n  leaf: {connector: A}\n")
    code, _, err = run_cli("vllm-args", "--offline", str(path))
    assert code == 1
    assert err == (
        f"{path}:1: kv_role: required to start vLLM: set kv_role at the top of the "
        "config (kv_producer, kv_consumer or kv_both)\n"
    )
    code, out, _ = run_cli(
        "vllm-args", "--offline", "--json", str(path), "--set", "kv_role=kv_consumer"
    )
    assert code == 0 and json.loads(out)["kv_role"] == "kv_consumer"


def test_convert_both_ways(run_cli, tmp_path: Path) -> None:
    code, out, err = run_cli("convert", "--offline", str(EXAMPLES / "multiconnector-dropin.json"))
    assert code == 0
    assert out.startswith("# Converted from multiconnector-dropin.json by `kvcompose convert`.")
    assert "now inherits kv_load_failure_policy='recompute'" in err
    yaml_file = tmp_path / "converted.yaml"
    yaml_file.write_text(out)
    original = load_config(str(EXAMPLES / "multiconnector-dropin.json"), env={}, check_vllm=False)
    assert load_config(str(yaml_file), env={}, check_vllm=False).tree == original.tree
    code, out, _ = run_cli(
        "convert", "--offline", "--compat", str(yaml_file), "-o", str(tmp_path / "back.json")
    )
    assert code == 0 and out == ""
    back = json.loads((tmp_path / "back.json").read_text())
    assert back["kv_connector_module_path"] == "kvcompose.compat"
    assert load_config(back, env={}, check_vllm=False).tree == original.tree


def test_convert_refuses_non_flat(run_cli) -> None:
    code, out, err = run_cli("convert", "--offline", str(EXAMPLES / "route-by-params.yaml"))
    assert code == 1 and out == ""
    assert "cannot convert to vLLM's MultiConnector: the root is a route" in err


def test_schema(run_cli, tmp_path: Path) -> None:
    code, out, _ = run_cli("schema")
    assert code == 0
    assert json.loads(out) == json_schema()
    code, _, _ = run_cli("schema", "--markdown", "-o", str(tmp_path / "c.md"))
    assert code == 0
    assert (tmp_path / "c.md").read_text() == (ROOT / "docs" / "config.md").read_text()


def test_schema_validates_the_examples() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    schema = json_schema()
    for example in sorted(EXAMPLES.glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tree": {"leaf": {"conector": "A"}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tree": {"chain": {"children": []}}}, schema)


def test_output_that_cannot_be_written_is_a_clean_error(run_cli, tmp_path: Path) -> None:
    code, _, err = run_cli("schema", "-o", str(tmp_path / "missing" / "schema.json"))
    assert code == 1 and err.startswith("kvcompose: cannot write ") and "No such file" in err
    code, _, err = run_cli("convert", "--offline", str(TIERS), "-o", str(tmp_path))
    assert code == 1 and "Is a directory" in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_standard_output_on_a_full_disk_is_a_clean_error() -> None:
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "kvcompose.cli", "vllm-args", "--offline", str(TIERS)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
    assert proc.returncode == 1
    assert proc.stderr == "kvcompose: cannot write the output: No space left on device\n"


def test_module_entry_point_runs_as_a_program(tmp_path: Path) -> None:
    """``python -m kvcompose.cli`` (what the ``kvcompose`` script runs): real process, real
    exit codes, output on the right streams."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("tree:\n  route:\n    children: [{leaf: {connector: A}}]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", "validate", "--offline", str(TIERS), str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stdout == f"{TIERS}: ok (3 nodes, 2 leaves; vLLM not checked)\n"
    assert proc.stderr == (
        f"{bad}:2: tree.route: missing required key 'default' (name of the child used "
        "when no rule matches)\n"
    )


@pytest.mark.vllm_process
@needs_vllm
def test_vllm_args_stdout_is_clean_json_with_vllm(tmp_path: Path) -> None:
    """vLLM logs to stdout when imported; the CLI keeps it quiet so the output pipes."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcompose.cli",
            "vllm-args",
            "--json",
            str(EXAMPLES / "pd-disk-tier.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kv_connector"] == "KVCompose"


def test_internal_form_files_are_validated_and_convertible(run_cli, tmp_path: Path) -> None:
    """A --kv-transfer-config holding the canonical tree (``kvcompose_tree``, as the test
    helpers build it) is checked like any document when it comes from a file."""
    from kvcompose.testing.trees import chain, kvcompose_config

    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            kvcompose_config(
                chain(
                    "root",
                    {"kind": "leaf", "name": "a", "connector": "ExampleConnector"},
                    {"kind": "leaf", "name": "b", "connector": "ExampleConnector"},
                )
            )
        )
    )
    code, out, err = run_cli("validate", "--offline", str(good))
    assert (code, err) == (0, "")
    code, out, _ = run_cli("convert", "--offline", str(good))
    assert code == 0 and "name: root" in out and "kv_role: kv_both" in out
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            kvcompose_config(
                chain(
                    "root",
                    {"kind": "leaf", "name": "a", "connector": "ExampleConnector"},
                    {"kind": "leaf", "name": "a", "connector": "ExampleConnector"},
                )
            )
        )
    )
    code, _, err = run_cli("validate", "--offline", str(bad))
    assert code == 1
    assert err == (
        f"{bad}: tree.chain.children[1].leaf.name: duplicate node name 'a' (also "
        "used at tree.chain.children[0].leaf.name)\n"
    )


def test_standard_input(run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("tree:\n  leaf: {conector: A}\n"))
    code, _, err = run_cli("validate", "--offline", "-")
    assert code == 1
    assert (
        err == "<stdin>:2: tree.leaf.conector: unknown key 'conector' (did you mean 'connector'?)\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(TIERS.read_text()))
    code, out, _ = run_cli("vllm-args", "--offline", "--json", "-")
    assert code == 0 and json.loads(out)["kv_connector_extra_config"]["tree"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(TIERS.read_text()))
    code, _, err = run_cli("vllm-args", "--offline", "--by-path", "-")
    assert (code, err) == (1, "<stdin>: this config does not come from a file: print it inline\n")


def _chain_file(tmp_path: Path, policy: str, *leaves: str) -> Path:
    """A config file of one chain under ``policy`` over ``leaves`` (flow-style mappings)."""
    path = tmp_path / "t.yaml"
    path.write_text(
        f"kv_role: kv_both\ntree:\n  chain:\n    policy: {policy}\n    children:\n"
        + "".join(f"      - leaf: {leaf}\n" for leaf in leaves)
    )
    return path


def test_explain_shows_each_stitch_childs_range_mode(run_cli, tmp_path: Path) -> None:
    path = _chain_file(
        tmp_path,
        "stitch",
        "{name: ram, connector: PrefixStoreConnector, module_path: kvcompose.stores,"
        " extra_config: {path: /tmp/x}}",
        "{name: whole, connector: ExampleConnector}",
        "{name: mine, connector: MyStore, load_range: native, load_range_alignment: 64}",
        "{name: nixl, connector: NixlConnector}",
    )
    code, out, err = run_cli("explain", "--offline", str(path))
    assert code == 0, err
    assert "chain, policy stitch: asks children in order, each where the earlier ones end" in out
    assert "load range: native (looked up at a, loads exactly [a, a + n)" in out
    assert "load range: sole_owner (loads every stored token of the prompt" in out
    assert "load range: native, starts on 64 tokens (set in the tree (the table says" in out
    assert "load range: last_segment (pulls every unhashed block" in out


def test_explain_shows_how_fastest_treats_each_childs_speed(run_cli, tmp_path: Path) -> None:
    """A child with ``expect_read`` is trusted at once; one without is cold: one load at a
    time, probed with short loads where it can be cut (``Costs.probe_tokens``), not where it
    cannot (a Mooncake store's load is what it offered)."""
    path = _chain_file(
        tmp_path,
        "fastest",
        "{name: told, connector: PrefixStoreConnector, module_path: kvcompose.stores,"
        " extra_config: {path: /tmp/x}, expect_read: {latency_ms: 2, gbps: 3}}",
        "{name: cold, connector: PrefixStoreConnector, module_path: kvcompose.stores,"
        " extra_config: {path: /tmp/y}}",
        "{name: whole, connector: MooncakeStoreConnector}",
    )
    code, out, err = run_cli("explain", "--offline", str(path))
    assert code == 0, err
    flat = " ".join(out.replace("│", " ").split())  # rich wraps long lines in the tree
    told, cold, whole = flat.split("load cost until measured: ")[1:]
    assert told.startswith("2 ms + bytes at 3 GB/s (expect_read; replaced by its timed loads)")
    assert cold.startswith(
        "1 ms + bytes at 1 GB/s (the default, a guess: one load at a time, probed with 128 "
        "tokens, then with the shortest load its first time says pays (at most 512), until 2 "
        "loads are timed or one already beats computing; replaced by its timed loads)"
    )
    assert whole.startswith(
        "1 ms + bytes at 1 GB/s (the default, a guess: one load at a time, until 2 loads are "
        "timed or one already beats computing; replaced by its timed loads)"
    )


def test_explain_the_stitch_example(run_cli) -> None:
    code, out, err = run_cli("explain", "--offline", str(EXAMPLES / "stitch-tiers.yaml"))
    assert code == 0, err
    assert out.count("load range: native") == 2


STORE_TIERS = """\
version: 1
tree:
  chain:
    name: tiers
    children:
      - leaf:
          name: fast
          connector: PrefixStoreConnector
          module_path: kvcompose.stores
          extra_config: {path: /dev/shm/kv, admit_when: {param: tenant, equals: premium}}
      - leaf:
          name: disk
          connector: PrefixStoreConnector
          module_path: kvcompose.stores
          extra_config: {path: /tmp/kv, chunk_blocks: 0}
"""


def test_validate_checks_kvcompose_store_leaves(run_cli, tmp_path: Path) -> None:
    """A store leaf's ``extra_config`` is read by the store's own model: what the engine
    would refuse at start is an error here, with the line."""
    bad = tmp_path / "stores.yaml"
    bad.write_text(STORE_TIERS)
    code, _, err = run_cli("validate", "--offline", str(bad))
    assert code == 1
    assert err == (
        f"{bad}:15: tree.chain.children[1].leaf.extra_config: PrefixStoreConnector: "
        "chunk_blocks: must be >= 1, got 0\n"
    )
    good = tmp_path / "good.yaml"
    good.write_text(STORE_TIERS.replace(", chunk_blocks: 0", ""))
    code, out, _ = run_cli("validate", "--offline", str(good))
    assert (code, out) == (0, f"{good}: ok (3 nodes, 2 leaves; vLLM not checked)\n")
    code, out, _ = run_cli("explain", "--offline", str(good))
    assert code == 0
    assert "requests where kv_transfer_params has 'tenant' == 'premium'" in out
