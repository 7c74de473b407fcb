"""``kvcompose serve``: the server command for a config, with the environment its leaves
need, every vLLM flag passed through unchanged (printed, or run with ``--run``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvcompose.cli import serve_cmd
from kvcompose.testing.mooncake import shim_dir

#: kvcompose's own machinery, run once (not in scripts/test.sh's vLLM 0.33 phase, whose lean
#: environment has no nixl-cu12 to make the libibverbs folder from)
pytestmark = pytest.mark.version_neutral

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "examples" / "shared-tier-mooncake.yaml"
PLAIN = ROOT / "examples" / "two-disk-tiers.yaml"
FLAGS = ["--model", "/m", "--port", "8001", "--dtype=float32", "--block-size", "128", "--x"]


def printed(out: str) -> tuple[dict[str, str], list[str]]:
    """The exports and the command of ``serve``'s output."""
    env, argv = {}, []
    for line in out.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = shlex.split(value)[0]
        elif line and not line.startswith("#"):
            argv = shlex.split(line)
    return env, argv


def test_a_mooncake_tree_gets_its_environment_and_the_flags_unchanged(
    run_cli, tmp_path: Path
) -> None:
    settings = tmp_path / "mooncake.json"
    settings.write_text("{}")
    code, out, err = run_cli(
        "serve", "--offline", "--mooncake-config", str(settings), str(SHARED), "--", *FLAGS
    )
    assert code == 0, err
    env, argv = printed(out)
    assert env["MOONCAKE_CONFIG_PATH"] == str(settings.resolve())
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(shim_dir())
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3 : 3 + len(FLAGS)] == FLAGS, "the server's flags are passed unchanged"
    assert argv[-2] == "--kv-transfer-config"
    _, vllm_args, _ = run_cli("vllm-args", "--offline", "--json", str(SHARED))
    assert json.loads(argv[-1]) == json.loads(vllm_args)


def test_a_mooncake_tree_without_its_settings_file_is_refused(run_cli, monkeypatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    code, _, err = run_cli("serve", "--offline", str(SHARED), "--", "--model", "/m")
    assert code == 1 and "MOONCAKE_CONFIG_PATH" in err


def test_a_plain_tree_needs_no_environment(run_cli) -> None:
    code, out, _ = run_cli("serve", "--offline", str(PLAIN), "--", "--model", "/m")
    env, argv = printed(out)
    assert code == 0 and env == {} and argv[3:5] == ["--model", "/m"]


def test_a_kv_transfer_config_flag_is_refused(run_cli) -> None:
    code, _, err = run_cli("serve", "--offline", str(PLAIN), "--", "--kv-transfer-config={}")
    assert code == 1 and "comes from FILE" in err


def test_everything_after_the_file_goes_to_the_server(run_cli) -> None:
    code, out, _ = run_cli("serve", "--offline", str(PLAIN), "--model", "/m", "--offline")
    assert code == 0 and printed(out)[1][3:6] == ["--model", "/m", "--offline"]


def test_run_starts_the_server_with_the_environment(
    run_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = tmp_path / "mooncake.json"
    settings.write_text("{}")
    started: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(
        serve_cmd, "_exec", lambda path, argv, env: started.append((path, argv, env))
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(settings))
    code, out, _ = run_cli("serve", "--offline", "--run", str(SHARED), "--", *FLAGS)
    assert code == 0 and out == ""
    [(path, argv, env)] = started
    assert argv[0] == path and argv[3 : 3 + len(FLAGS)] == FLAGS
    assert env["MOONCAKE_CONFIG_PATH"] == str(settings.resolve())
    assert str(shim_dir()) in env["LD_LIBRARY_PATH"].split(":")
