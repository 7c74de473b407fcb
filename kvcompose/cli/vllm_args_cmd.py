"""``kvcompose vllm-args FILE``: the exact ``--kv-transfer-config`` for vLLM."""

from __future__ import annotations

import argparse
import sys

from kvcompose.cli.common import FILE_HELP, add_load_flags, cli_overrides, load
from kvcompose.config.render import python_form, shell_arg, to_json, vllm_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm-args",
        help="print the --kv-transfer-config that loads a config",
        description="Print the vLLM --kv-transfer-config JSON (and the Python "
        "KVTransferConfig form) that loads a config as the KVCompose connector.",
    )
    parser.add_argument("file", metavar="FILE", help=FILE_HELP)
    parser.add_argument(
        "--by-path",
        action="store_true",
        help='reference the file ({"config": "/abs/path"}) instead of '
        "putting the tree inline; the file must exist where vLLM runs",
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print only the JSON, on one line")
    form.add_argument(
        "--python", action="store_true", help="print only the Python KVTransferConfig form"
    )
    parser.add_argument(
        "--no-module-path",
        action="store_true",
        help="omit kv_connector_module_path (needs the kvcompose vLLM plugin, "
        "installed with the package)",
    )
    add_load_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load(args, args.file)
    data = vllm_args(config, by_path=args.by_path, module_path=not args.no_module_path)
    if args.by_path and args.overrides:
        # the file does not hold the --set values: pass them along as override keys
        data["kv_connector_extra_config"]["set"] = {o.key: o.value for o in cli_overrides(args)}
    env_applied = [o for o in config.overrides if o.startswith("KVCOMPOSE_")]
    if args.by_path and env_applied:
        print(
            "note: environment overrides were applied here; with --by-path vLLM applies "
            "the environment it runs with: " + ", ".join(env_applied),
            file=sys.stderr,
        )
    if args.json:
        print(to_json(data))
    elif args.python:
        print(python_form(data))
    else:
        print("# vllm serve MODEL ... \\")
        print(shell_arg(data))
        print()
        print("# or, in Python:")
        print(python_form(data))
    return 0
