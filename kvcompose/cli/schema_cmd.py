"""``kvcompose schema``: the JSON Schema of the config format (or its Markdown reference)."""

from __future__ import annotations

import argparse
import json

from kvcompose.cli.common import emit
from kvcompose.config import json_schema


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schema",
        help="print the JSON Schema of the config format",
        description="Print the JSON Schema of kvcompose config documents (for editors and "
        "CI), or with --markdown the reference in docs/config.md.",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the Markdown reference (docs/config.md) instead",
    )
    parser.add_argument(
        "--stores",
        action="store_true",
        help="print the store's settings table (docs/stores.md) instead",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE, not stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.markdown:
        from kvcompose.config.docs import render_markdown

        text = render_markdown()
    elif args.stores:
        from kvcompose.config.docs import settings_table
        from kvcompose.stores.prefix.config import PrefixStoreConfig

        text = settings_table(PrefixStoreConfig) + "\n"
    else:
        text = json.dumps(json_schema(), indent=2) + "\n"
    emit(text, args.output)
    return 0
