"""Real vLLM engines on CPU for tests and smoke runs.

``make_llm`` yields a single-process ``vllm.LLM`` (scheduler and worker in the caller's
process, so both connector instances live here too) and tears it down so that several engines
can run one after another in one process. ``greedy`` runs token-id prompts greedily.

Run ``python -m kvcompose.testing.engine --smoke`` for an end-to-end check: build the tiny
model, store KV with vLLM's ExampleConnector, reload it in a fresh engine, compare outputs.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Environment every engine here needs. Set before vLLM (and torch/OpenMP) is imported:
#: OMP_WAIT_POLICY=PASSIVE matters on 2 cores (spinning OpenMP threads make generation
#: 10-30x slower), multiprocessing off makes an engine start in seconds.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_env(env: dict[str, str] | None = None, *, override: bool = False) -> dict[str, str]:
    """Put ``ENGINE_ENV`` into ``env`` (default ``os.environ``) and return it.

    Existing values are kept unless ``override``.
    """
    target = os.environ if env is None else env
    for key, value in ENGINE_ENV.items():
        if override:
            target[key] = value
        else:
            target.setdefault(key, value)
    return target  # type: ignore[return-value]


engine_env()

#: Defaults for ``vllm.LLM`` in ``make_llm`` (any can be overridden by keyword).
LLM_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 1024,
    "seed": 0,
    "max_num_seqs": 8,
}


@contextlib.contextmanager
def make_llm(
    model_dir: str | os.PathLike[str],
    kv_transfer_config: dict[str, Any] | None = None,
    **kw: Any,
) -> Iterator[Any]:
    """A single-process ``vllm.LLM`` for ``model_dir``, torn down on exit.

    ``kv_transfer_config`` is the dict form of ``KVTransferConfig``; ``kv_role`` defaults to
    ``"kv_both"``. Other keywords go to ``vllm.LLM`` (over ``LLM_DEFAULTS``).
    """
    engine_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = {**LLM_DEFAULTS, **kw}
    if kv_transfer_config is not None:
        cfg = dict(kv_transfer_config)
        cfg.setdefault("kv_role", "kv_both")
        args["kv_transfer_config"] = KVTransferConfig(**cfg)
    llm = LLM(model=str(model_dir), **args)
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        del llm
        cleanup()


def shutdown_llm(llm: Any) -> None:
    """Shut an engine's core (scheduler, executor, worker, connectors) down."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        with contextlib.suppress(Exception):
            core.shutdown()


def cleanup() -> None:
    """Free what an engine left behind so the next one starts clean."""
    gc.collect()
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    gc.collect()


def sampling_params(max_tokens: int = 8, **kw: Any) -> Any:
    """Greedy sampling, fixed length (EOS ignored), as the tests compare outputs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def greedy(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int = 8,
    *,
    kv_transfer_params: dict[str, Any] | list[dict[str, Any] | None] | None = None,
    return_outputs: bool = False,
) -> Any:
    """Greedy-generate from token-id prompts; returns one list of token ids per prompt.

    ``kv_transfer_params`` (one dict for all, or one per prompt) goes into each request's
    ``SamplingParams.extra_args``. With ``return_outputs=True`` the ``RequestOutput``
    objects are returned instead.
    """
    from vllm.inputs import TokensPrompt

    if kv_transfer_params is None or isinstance(kv_transfer_params, dict):
        per_prompt = [kv_transfer_params] * len(prompts)
    else:
        per_prompt = list(kv_transfer_params)
        if len(per_prompt) != len(prompts):
            raise ValueError("one kv_transfer_params per prompt")
    params = [
        sampling_params(max_tokens, extra_args={"kv_transfer_params": dict(p)} if p else None)
        for p in per_prompt
    ]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    if return_outputs:
        return outputs
    return [list(o.outputs[0].token_ids) for o in outputs]


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


# ----------------------------------------------------------------------------- smoke


def smoke(model_dir: str | os.PathLike[str] | None = None, *, max_tokens: int = 8) -> bool:
    """Store with ExampleConnector, reload in a fresh engine, compare. Prints a report."""
    import tempfile
    import time

    from kvcompose.testing.tiny_model import build_tiny_model, default_cache_dir

    t0 = time.perf_counter()
    if model_dir is None:
        model_dir = build_tiny_model(default_cache_dir() / "tiny-llama")
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

    ap = argparse.ArgumentParser(prog="python -m kvcompose.testing.engine")
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
