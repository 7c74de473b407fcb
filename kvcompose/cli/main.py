"""``kvcompose`` entry point: argparse, pluggable subcommands, errors as one line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

#: Subcommand modules (``kvcompose.cli.<name>_cmd``), in help order. Each ships with the
#: package and imports only the package's own dependencies at the top (``bench`` and ``proxy``
#: import vLLM, httpx and the like when they run), so one that cannot be imported is a bug:
#: it fails loudly rather than vanishing from ``--help``.
COMMANDS: tuple[str, ...] = (
    "validate",
    "explain",
    "vllm_args",
    "serve",
    "convert",
    "schema",
    "bench",
    "proxy",
)

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_TERMINATED = 128 + signal.SIGTERM  # a shell's status for a process ended by SIGTERM
#: Errors of a write with no file named: standard output (a full disk, a terminal gone).
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG})


def _quiet_vllm() -> None:
    """vLLM logs to stdout at INFO; keep ``vllm-args`` output clean (users can override)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)  # "Triton not available"


def load_commands() -> list[object]:
    return [importlib.import_module(f"kvcompose.cli.{name}_cmd") for name in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    from kvcompose import __version__

    parser = argparse.ArgumentParser(
        prog="kvcompose",
        description="Compose vLLM KV-cache connectors: check, draw and deploy connector trees.",
    )
    parser.add_argument("--version", action="version", version=f"kvcompose {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in load_commands():
        module.add_parser(subparsers)  # type: ignore[attr-defined]
    return parser


def _drop_stdout() -> None:
    """Point standard output at /dev/null, so that the flush at exit does not fail again."""
    with contextlib.suppress(OSError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_vllm()
    from kvcompose.cli.common import CLIError
    from kvcompose.config import ConfigError

    debug = os.environ.get("KVCOMPOSE_DEBUG") == "1"
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse: --help, usage errors
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(args.func(args) or 0)
    except SystemExit as exc:  # from code the command ran (a connector module, a plugin)
        if exc.code == EXIT_TERMINATED:  # the bench's SIGTERM handler: cleaned up, now stop
            print("kvcompose: stopped by SIGTERM", file=sys.stderr)
            return EXIT_TERMINATED
        if debug:
            raise
        print(
            f"kvcompose: internal error: something called sys.exit({exc.code!r}) "
            "(set KVCOMPOSE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    except (ConfigError, CLIError) as exc:
        if debug:
            raise
        print(str(exc), file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_OK
    except OSError as exc:
        if debug:
            raise
        # what the commands leave to here: standard output that cannot be written (a full
        # disk, a closed terminal), or a file or socket the system refused
        what = f"{exc.filename}: " if exc.filename else ""
        if exc.filename is None and exc.errno in _OUTPUT_ERRNOS:
            _drop_stdout()
            what = "cannot write the output: "
        print(f"kvcompose: {what}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        if debug:
            raise
        text = (str(exc).splitlines() or [""])[0][:300]
        print(
            f"kvcompose: internal error: {type(exc).__name__}: {text} "
            "(set KVCOMPOSE_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
