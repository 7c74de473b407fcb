"""Helpers for the hostile-input tests: the message an input gets in process, and the CLI
run as a real program with a check that what comes back is one clean line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from config_helpers import ROOT

from kvcompose.config import ConfigError, load_config, tree_from_extra_config
from kvcompose.config.limits import MAX_MESSAGE

HOSTILE = Path(__file__).resolve().parent / "hostile"
#: The smallest valid document, to append to.
LEAF = "tree:\n  leaf:\n    connector: ExampleConnector\n"


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The one-line message of the ``ConfigError`` that ``fn`` raises."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) <= MAX_MESSAGE
    return message


def from_extra(extra: Any, **kwargs: Any) -> str:
    """The message ``tree_from_extra_config`` (vLLM's path) gives for ``extra``."""
    return error_of(
        tree_from_extra_config,
        extra,
        env=kwargs.pop("env", {}),
        check_vllm=kwargs.pop("check_vllm", False),
    )


def load(source: Any, **kwargs: Any) -> str:
    """The message ``load_config`` gives for ``source``."""
    return error_of(
        load_config, source, env=kwargs.pop("env", {}), check_vllm=kwargs.pop("check_vllm", False)
    )


def cli(
    *args: str,
    cwd: Path | str,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    pythonpath: tuple[str, ...] = (),
    timeout: float = 120,
) -> tuple[int, str, str]:
    """``python -m kvcompose.cli ARGS`` in ``cwd`` -> (exit status, stdout, stderr), with
    no ``KVCOMPOSE_*`` variables but those in ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVCOMPOSE_")}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *pythonpath])
    environ.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.cli", *args],
        cwd=cwd,
        input=stdin if stdin is not None else b"",
        capture_output=True,
        env=environ,
        timeout=timeout,
    )
    return (
        proc.returncode,
        proc.stdout.decode("utf-8", "replace"),
        proc.stderr.decode("utf-8", "replace"),
    )


def assert_clean_error(
    result: tuple[int, str, str], expected: str | None = None, *, prefix: bool = False
) -> str:
    """Exit status 1, nothing on stdout, one line on stderr and no traceback; that line
    (``expected`` exactly, or starting with it) is returned."""
    code, out, err = result
    assert "Traceback" not in err, err[-2000:]
    assert code == 1, (code, err[-2000:])
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err[-2000:]
    line = err[:-1]
    if expected is not None:
        assert line.startswith(expected) if prefix else line == expected
    return line
