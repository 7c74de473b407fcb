"""``kvcompose proxy``: flags and YAML make one config; the verb serves the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvcompose.cli.main import main
from kvcompose.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_flags_and_yaml_merge(tmp_path, capsys):
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text("prefill: [p1:8100]\ndecode: [http://d1:8200/]\nmax_attempts: 6\n")
    assert main(["proxy", "--config", str(cfg), "--decode", "d2:8200", "--check"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prefill"] == ["http://p1:8100"] and data["decode"] == ["http://d2:8200"]
    assert data["max_attempts"] == 6


def test_bad_settings_are_one_line_errors(capsys):
    assert main(["proxy", "--prefill", "p", "--check"]) == 1
    assert "decode" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "file", "message"),
    [
        (["--prefill", "ftp://a", "--decode", "b"], None, "--prefill: 'ftp://a': the scheme"),
        (["--prefill", "a:99999", "--decode", "b"], None, "is not a URL (Port out of range"),
        (["--prefill", "http://[::1", "--decode", "b"], None, "is not a URL (Invalid IPv6"),
        (["--prefill", "http://", "--decode", "b"], None, "'http://': no host"),
        (["--prefill", "a?x=1", "--decode", "b"], None, "no query or fragment"),
        (
            ["--prefill", "a", "--decode", "b", "--max-attempts", "0"],
            None,
            "--max-attempts: must be >= 1, got 0",
        ),
        ([], "prefill: [p1, 3]\ndecode: [d]\n", "proxy.yaml:1: prefill[1]: expected a string"),
        ([], "prefill: [p]\ndecode: [d]\ndecode: [e]\n", "proxy.yaml:3: decode: duplicate key"),
        ([], "prefill: [p]\ndecode: [d]\nmax_atempts: 3\n", "(did you mean 'max_attempts'?)"),
        ([], "prefill: [p]\ndecode: [d]\ntimeouts: {read: -1}\n", ":3: timeouts.read: "),
        ([], "- a list\n", "proxy.yaml: expected a mapping at the top level, got a list"),
        ([], b"a: \x80\x81", "proxy.yaml:1: not UTF-8 text"),
    ],
)
def test_bad_settings_name_the_flag_or_the_line(tmp_path, capsys, argv, file, message):
    """Every bad setting, from a flag or the file, is one line before anything starts."""
    if file is not None:
        cfg = tmp_path / "proxy.yaml"
        cfg.write_bytes(file if isinstance(file, bytes) else file.encode())
        argv = [*argv, "--config", str(cfg)]
    assert main(["proxy", *argv, "--check"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_config_file_that_never_ends_is_refused(capsys):
    assert main(["proxy", "--config", "/dev/zero", "--check"]) == 1
    assert "too large for a config file" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value"), [("--port", "99999"), ("--port", "-1"), ("--host", "")])
def test_bad_listen_address_is_a_usage_error(capsys, flag, value):
    assert main(["proxy", "--prefill", "p", "--decode", "d", flag, value, "--check"]) == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_the_verb_serves_the_app():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcompose.cli",
            "proxy",
            "--prefill",
            "127.0.0.1:9",
            "--decode",
            "127.0.0.1:9",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        assert resp.status_code == 503  # nothing listens on port 9: both out of rotation
        assert resp.json()["down"] == {
            "prefill": ["http://127.0.0.1:9"],
            "decode": ["http://127.0.0.1:9"],
        }
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_port_in_use_is_a_clean_error():
    """uvicorn exits with status 3 when it cannot bind; the verb says so in one line."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["proxy", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9", "--port"]
        proc = subprocess.run(
            [sys.executable, "-m", "kvcompose.cli", *argv, str(port), "--log-level", "error"],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvcompose proxy: the server did not start on 127.0.0.1:{port} (uvicorn's error is above)"
    )


def test_the_uvicorn_factory_needs_its_variable(monkeypatch):
    from kvcompose.config import ConfigError
    from kvcompose.proxy.app import app_from_env

    monkeypatch.delenv("KVCOMPOSE_PROXY_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="KVCOMPOSE_PROXY_CONFIG is not set"):
        app_from_env()


def test_the_example_config_loads():
    from kvcompose.proxy import load_proxy_config

    config = load_proxy_config(ROOT / "examples" / "pd" / "proxy.yaml")
    assert config.prefill == ["http://127.0.0.1:8100"]
    assert config.decode == ["http://127.0.0.1:8200"]
