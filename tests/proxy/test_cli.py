"""``kvcompose proxy``: flags and YAML make one config; the verb serves the app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvcompose.cli.main import main
from kvcompose.testing.pd import free_port

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


def test_the_example_config_loads():
    from kvcompose.proxy import load_proxy_config

    config = load_proxy_config(ROOT / "examples" / "pd" / "proxy.yaml")
    assert config.prefill == ["http://127.0.0.1:8100"]
    assert config.decode == ["http://127.0.0.1:8200"]
