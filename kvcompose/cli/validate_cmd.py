"""``kvcompose validate FILE...``: exit 0 when every file is a valid config."""

from __future__ import annotations

import argparse
import sys

from kvcompose.cli.common import FILE_HELP, CLIError, add_load_flags, load
from kvcompose.config import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check config files",
        description="Check kvcompose configs (YAML/JSON documents, MultiConnector JSON, or "
        "what `kvcompose vllm-args` prints). Exit status 0 when all are valid. "
        "Without vLLM by default (fast, for editors and CI); --check-vllm adds "
        "the checks against the installed vLLM (connector names, modules, HMA).",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help=FILE_HELP)
    parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
    parser.add_argument(
        "--all-errors",
        action="store_true",
        help="print every problem found, one per line, not just the first",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    add_load_flags(parser, vllm_by_default=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            config = load(args, path)
        except ConfigError as exc:
            failed += 1
            for line in exc.lines if args.all_errors else [str(exc)]:
                print(line, file=sys.stderr)
            continue
        except CLIError as exc:
            failed += 1
            print(str(exc), file=sys.stderr)
            continue
        for warning in config.warnings:
            print(f"{path}: warning: {warning}", file=sys.stderr)
        if args.strict and config.warnings:
            failed += 1
            continue
        if not args.quiet:
            leaves = sum(1 for n in config.nodes.values() if n.kind == "leaf")
            checked = "checked against vLLM" if config.facts is not None else "vLLM not checked"
            print(
                f"{path}: ok ({len(config.nodes)} nodes, {leaves} "
                f"{'leaf' if leaves == 1 else 'leaves'}; {checked})"
            )
    return 1 if failed else 0
