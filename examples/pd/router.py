#!/usr/bin/env python3
"""A minimal prefill/decode router for two vLLM OpenAI servers (standard library only).

For each prompt it does what a P/D proxy does:

1. POST /v1/completions to the prefill engine with ``max_tokens: 1`` and
   ``kv_transfer_params: {"do_remote_decode": true}``: P computes the prompt and keeps its
   KV blocks for D; the response carries the ``kv_transfer_params`` D needs (P's engine id,
   block ids, host and port);
2. POST /v1/completions to the decode engine with those ``kv_transfer_params`` and
   ``stream: true``: D loads the prompt's KV (over NIXL from P, or from its own disk tier)
   and streams the decoded text, which is printed as it arrives.

    python examples/pd/router.py "w5 w17 w33 ..." --max-tokens 16
    python examples/pd/router.py --words 300 --repeat 2     # a generated prompt, twice

``--show-params`` prints the hand-off. Works against any vLLM pair started with a P/D
connector (e.g. examples/pd/serve.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any


def post(url: str, body: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def model_name(base: str, timeout: float) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as resp:
        return json.load(resp)["data"][0]["id"]


def prefill(base: str, model: str, prompt: str, timeout: float) -> dict[str, Any]:
    """Run the prompt on P; return the kv_transfer_params P hands to D."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    with post(f"{base}/v1/completions", body, timeout) as resp:
        out = json.load(resp)
    params = out.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"the prefill engine returned no kv_transfer_params: {out}")
    return params


def decode(
    base: str, model: str, prompt: str, params: dict[str, Any], max_tokens: int, timeout: float
) -> Iterator[str]:
    """Run the prompt on D with P's kv_transfer_params; yield text as D streams it."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "kv_transfer_params": params,
    }
    with post(f"{base}/v1/completions", body, timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return
            for choice in json.loads(data).get("choices", ()):
                if choice.get("text"):
                    yield choice["text"]


def route(
    prompt: str,
    *,
    prefill_url: str,
    decode_url: str,
    max_tokens: int,
    show_params: bool = False,
    timeout: float = 300.0,
) -> str:
    model = model_name(decode_url, timeout)
    t0 = time.monotonic()
    params = prefill(prefill_url, model, prompt, timeout)
    t1 = time.monotonic()
    if show_params:
        print(f"[router] P -> D kv_transfer_params: {json.dumps(params)}", file=sys.stderr)
    text = []
    for piece in decode(decode_url, model, prompt, params, max_tokens, timeout):
        text.append(piece)
        print(piece, end="", flush=True)
    print()
    print(
        f"[router] prefill {1000 * (t1 - t0):.0f} ms, decode "
        f"{1000 * (time.monotonic() - t1):.0f} ms",
        file=sys.stderr,
    )
    return "".join(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt", nargs="?", help="the prompt text (default: --words N words)")
    ap.add_argument(
        "--words",
        type=int,
        default=300,
        help="generate a prompt of N words of the tiny test model's vocabulary",
    )
    ap.add_argument("--prefill", default="http://127.0.0.1:8100", help="prefill server URL")
    ap.add_argument("--decode", default="http://127.0.0.1:8200", help="decode server URL")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="send the same prompt N times")
    ap.add_argument("--show-params", action="store_true", help="print the hand-off")
    args = ap.parse_args()
    prompt = args.prompt or " ".join(
        f"w{(31 * i + (i * i) % 17) % 1000}" for i in range(args.words)
    )
    for _ in range(args.repeat):
        route(
            prompt,
            prefill_url=args.prefill,
            decode_url=args.decode,
            max_tokens=args.max_tokens,
            show_params=args.show_params,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
