"""Shared CLI plumbing: loading configs with the common flags, output helpers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvcompose.cli.store_checks import check_stores
from kvcompose.config import Config, load_config, vllm_available
from kvcompose.config.env import Override, parse_assignments

#: Help for a FILE argument.
FILE_HELP = "a YAML or JSON config file, or - to read standard input"


class CLIError(Exception):
    """A user-facing error that is not about a config's content."""


def add_load_flags(parser: argparse.ArgumentParser, *, vllm_by_default: bool = True) -> None:
    """The flags every verb that loads a config takes.

    ``vllm_by_default``: whether the checks that import vLLM run unless ``--offline`` is
    given (``explain``, ``vllm-args``, ``convert``: their output depends on what vLLM
    reports), or only with ``--check-vllm`` (``validate``: answers from the file alone in a
    fraction of a second, where importing vLLM takes seconds).
    """
    if vllm_by_default:
        parser.add_argument(
            "--offline",
            action="store_true",
            help="skip the checks that import vLLM (connector names, modules, HMA)",
        )
        parser.set_defaults(check_vllm=None)
    else:
        parser.add_argument(
            "--check-vllm",
            action="store_true",
            help="also run the checks that import vLLM (connector names, "
            "modules and classes, HMA, KVTransferConfig fields); takes "
            "seconds",
        )
        parser.add_argument(
            "--offline",
            action="store_true",
            help="skip the vLLM checks (the default here; overrides --check-vllm)",
        )
    parser.add_argument(
        "--no-env", action="store_true", help="ignore KVCOMPOSE_* environment overrides"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="NODE.KEY=VALUE",
        help="override a setting (like KVCOMPOSE_SET; a key without a dot "
        "is a top-level field); repeatable",
    )


def cli_overrides(args: argparse.Namespace) -> list[Override]:
    out: list[Override] = []
    for text in args.overrides:
        out.extend(parse_assignments(text, "--set"))
    return out


def check_vllm(args: argparse.Namespace) -> bool | None:
    """``load_config``'s ``check_vllm`` for these flags (None: when vLLM is installed)."""
    if args.offline:
        return False
    if args.check_vllm is None:
        return None
    if args.check_vllm and not vllm_available():
        raise CLIError("--check-vllm: vLLM is not installed here")
    return bool(args.check_vllm)


def load(args: argparse.Namespace, path: str) -> Config:
    if path == "-":
        from kvcompose.config.files import read_stream

        stream = getattr(sys.stdin, "buffer", sys.stdin)
        source: Any = read_stream(stream)
    else:
        source = path
    config = load_config(
        source,
        env={} if args.no_env else None,
        overrides=cli_overrides(args),
        check_vllm=check_vllm(args),
    )
    check_stores(config)
    return config


def emit(text: str, output: str | None) -> None:
    """``text`` to the file ``output`` (``-o``), or to standard output; a file that cannot be
    written is a ``CLIError`` naming it."""
    if not output:
        print(text, end="")
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise CLIError(f"kvcompose: cannot write {output}: {exc.strerror or exc}") from None


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    width = None if (sys.stderr if stderr else sys.stdout).isatty() else 120
    return Console(stderr=stderr, width=width, highlight=False, emoji=False)
