"""Real vLLM engines for the tests (``kvcompose.engine.llm``), and the engine smoke run.

Run ``python -m kvcompose.testing.real_engine --smoke`` for an end-to-end check: build the tiny
model, store KV with vLLM's ExampleConnector, reload it in a fresh engine, compare outputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvcompose.engine.llm import ENGINE_ENV, engine_env, greedy, make_llm, sampling_params

__all__ = [
    "ENGINE_ENV",
    "engine_env",
    "example_connector_config",
    "example_prompts",
    "greedy",
    "make_llm",
    "sampling_params",
    "smoke",
    "stored_files",
]


def example_prompts(n: int = 2, length: int = 200, *, vocab_size: int = 1024) -> list[list[int]]:
    """Deterministic token-id prompts for the tiny model (word ids only)."""
    span = vocab_size - 4
    return [[4 + (97 * k + 31 * i + (i * i) % 13) % span for i in range(length)] for k in range(n)]


def example_connector_config(storage: str | os.PathLike[str]) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


def stored_files(storage: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files ExampleConnector wrote under ``storage``."""
    return sorted(Path(storage).rglob("*.safetensors"))


def smoke(model_dir: str | os.PathLike[str] | None = None, *, max_tokens: int = 8) -> bool:
    """Store with ExampleConnector, reload in a fresh engine, compare. Prints a report."""
    import tempfile
    import time

    from kvcompose.engine.model import tiny_model

    t0 = time.perf_counter()
    if model_dir is None:
        model_dir = tiny_model()
    print(f"[smoke] tiny model: {model_dir}")
    prompts = example_prompts(2, 200)
    with tempfile.TemporaryDirectory(prefix="kvcompose-smoke-") as storage:
        cfg = example_connector_config(storage)
        t = time.perf_counter()
        with make_llm(model_dir, cfg) as llm:
            first = greedy(llm, prompts, max_tokens)
        files = stored_files(storage)
        print(
            f"[smoke] run 1 (store): {len(files)} KV files written "
            f"in {time.perf_counter() - t:.1f} s"
        )
        t = time.perf_counter()
        with make_llm(model_dir, cfg) as llm:
            outs = greedy(llm, prompts, max_tokens, return_outputs=True)
        second = [list(o.outputs[0].token_ids) for o in outs]
        cached = [o.num_cached_tokens for o in outs]
        print(
            f"[smoke] run 2 (load):  fresh engine, {time.perf_counter() - t:.1f} s, "
            f"cached prompt tokens per request: {cached}"
        )
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        print(f"[smoke] prompt {i}: run 1 {a}")
        print(f"[smoke] prompt {i}: run 2 {b}")
    ok = first == second and bool(files) and all(c > 0 for c in cached)
    verdict = "MATCH" if first == second else "MISMATCH"
    print(
        f"[smoke] outputs {verdict}; KV loaded from the store: {all(c > 0 for c in cached)}; "
        f"total {time.perf_counter() - t0:.1f} s"
    )
    return ok


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvcompose.testing.real_engine")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="store with ExampleConnector, reload in a new engine, compare",
    )
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if not args.smoke:
        ap.print_help()
        return 2
    return 0 if smoke(args.model, max_tokens=args.max_tokens) else 1


if __name__ == "__main__":
    raise SystemExit(_main())
