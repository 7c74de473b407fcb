"""Shared CLI plumbing: loading configs with the common flags, output helpers."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvcompose.config import Config, load_config
from kvcompose.config.env import Override, parse_assignments


class CLIError(Exception):
    """A user-facing error that is not about a config's content."""


def add_load_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offline", action="store_true",
                        help="skip the checks that import vLLM (connector names, modules, HMA)")
    parser.add_argument("--no-env", action="store_true",
                        help="ignore KVCOMPOSE_* environment overrides")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="NODE.KEY=VALUE",
                        help="override a setting (like KVCOMPOSE_SET; a key without a dot "
                             "is a top-level field); repeatable")


def cli_overrides(args: argparse.Namespace) -> list[Override]:
    out: list[Override] = []
    for text in args.overrides:
        out.extend(parse_assignments(text, "--set"))
    return out


def load(args: argparse.Namespace, path: str) -> Config:
    if path != "-" and not os.path.exists(path):
        raise CLIError(f"{path}: no such file")
    if path == "-":
        from kvcompose.config.source import parse_yaml

        source: Any = parse_yaml(sys.stdin.read(), "<stdin>")  # YAML reads JSON too
        source.path = None
    else:
        source = path
    return load_config(source, env={} if args.no_env else None,
                       overrides=cli_overrides(args),
                       check_vllm=False if args.offline else None)


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    width = None if (sys.stderr if stderr else sys.stdout).isatty() else 120
    return Console(stderr=stderr, width=width, highlight=False)
