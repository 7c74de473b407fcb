"""The ``kvcompose`` command line (verb first: ``kvcompose validate FILE``).

Subcommands are plugged in by module: ``kvcompose.cli.main`` imports
``kvcompose.cli.<name>_cmd`` for every name in ``COMMANDS`` and skips optional ones that are
not installed. A command module defines::

    def add_parser(subparsers) -> None:
        parser = subparsers.add_parser("name", help="...", description="...")
        parser.add_argument(...)
        parser.set_defaults(func=run)

    def run(args) -> int: ...   # the exit status

Raise ``kvcompose.config.ConfigError`` (or ``kvcompose.cli.common.CLIError``) for a clean
one-line error; ``main`` never shows a traceback unless ``KVCOMPOSE_DEBUG=1``.
"""
