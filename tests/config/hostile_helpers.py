"""Running the CLI as a real program for the hostile-input tests, and checking that what
comes back is one clean line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from config_helpers import ROOT

HOSTILE = Path(__file__).resolve().parent / "hostile"


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
