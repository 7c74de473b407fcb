"""``kvcompose convert FILE``: MultiConnector JSON <-> kvcompose YAML."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvcompose.cli.common import FILE_HELP, add_load_flags, emit, load
from kvcompose.config.files import read_file
from kvcompose.config.multiconnector import document_notes, multiconnector_from_config
from kvcompose.config.render import document_from_tree, simplify_document, to_yaml


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="MultiConnector JSON -> kvcompose YAML, and back for flat trees",
        description="Convert vLLM MultiConnector JSON (or a KVCompose --kv-transfer-config) "
        "to a kvcompose YAML document, or a flat kvcompose tree (a 'first' chain "
        "of leaves that all save) back to MultiConnector JSON. The direction "
        "follows the input unless --to says otherwise.",
    )
    parser.add_argument("file", metavar="FILE", help=FILE_HELP)
    parser.add_argument(
        "--to", choices=("yaml", "multiconnector"), help="output format (default: the other one)"
    )
    parser.add_argument(
        "--compat",
        action="store_true",
        help="with --to multiconnector: load it as kvcompose.compat's "
        "MultiConnector (drop-in with kvcompose semantics) instead of "
        "vLLM's own",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE, not stdout")
    add_load_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load(args, args.file)
    target = args.to or ("yaml" if config.loaded_as is not None else "multiconnector")
    notes: list[str]
    if target == "yaml":
        document = config.document or document_from_tree(config.tree, config.transfer)
        notes = []
        if config.origin == "multiconnector" and args.file != "-":
            notes = document_notes(read_file(args.file).data, config.document)
        header = [f"Converted from {os.path.basename(args.file)} by `kvcompose convert`."]
        header += [f"note: {n}" for n in notes]
        text = to_yaml(simplify_document(document), "\n".join(header))
    else:
        data, notes = multiconnector_from_config(config, compat=args.compat)
        text = json.dumps(data, indent=2) + "\n"
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    emit(text, args.output)
    return 0
