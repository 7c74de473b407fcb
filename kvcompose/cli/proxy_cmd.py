"""``kvcompose proxy``: serve the prefill/decode router (kvcompose.proxy) with uvicorn."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy",
        help="serve a prefill/decode router in front of vLLM servers",
        description="An OpenAI-compatible router for disaggregated prefill/decode: prefill on "
        "one engine, decode on another with the prefill's kv_transfer_params, and "
        "token-exact retries when a decode fails, gives the request back or drops "
        "the stream (docs/proxy.md).",
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML file of proxy settings")
    parser.add_argument("--prefill", nargs="+", metavar="URL", help="prefill engines")
    parser.add_argument("--decode", nargs="+", metavar="URL", help="decode engines")
    parser.add_argument("--model", help="the served model name (default: the backends')")
    parser.add_argument("--max-attempts", type=int, help="attempts per request (default 4)")
    parser.add_argument("--host", type=_host, default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any)")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="print the settings as JSON and exit (nothing is started)",
    )
    parser.set_defaults(func=run)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return int(text)


def _host(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected an address, got an empty one")
    return text


def run(args: argparse.Namespace) -> int:
    import logging

    from kvcompose.cli.common import CLIError
    from kvcompose.config import ConfigError
    from kvcompose.proxy.config import load_proxy_config

    try:
        config = load_proxy_config(
            args.config,
            prefill=args.prefill,
            decode=args.decode,
            model=args.model,
            max_attempts=args.max_attempts,
        )
    except ConfigError as exc:
        raise CLIError(f"kvcompose proxy: {exc}") from None
    if args.check:
        print(config.model_dump_json(indent=2))
        return 0
    import uvicorn

    from kvcompose.proxy import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # no access log: its line per client request carries no request id (the proxy's own
        # ``req=<id> attempt=<k>`` lines say what happened to each request)
        uvicorn.run(
            create_app(config),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
        )
    except SystemExit as exc:  # uvicorn's own exit when the server cannot start
        if exc.code in (0, None):
            return 0
        raise CLIError(
            f"kvcompose proxy: the server did not start on {args.host}:{args.port} "
            "(uvicorn's error is above)"
        ) from None
    return 0
