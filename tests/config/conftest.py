"""Helpers for the config and CLI tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """``run_cli(*argv, env={...})`` -> (exit status, stdout, stderr), in process; the
    process environment is restored afterwards (``main`` sets vLLM's log level)."""
    from kvcompose.cli.main import main

    saved = dict(os.environ)

    def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        for key in [k for k in os.environ if k.startswith("KVCOMPOSE_")]:
            del os.environ[key]
        os.environ.update(env or {})
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    os.environ.clear()
    os.environ.update(saved)
