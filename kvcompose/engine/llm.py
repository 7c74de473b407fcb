"""Real vLLM engines on CPU, for the bench and the tests.

``make_llm`` yields a single-process ``vllm.LLM`` (scheduler and worker in the caller's
process, so both connector instances live here too) and tears it down so that several engines
can run one after another in one process. ``greedy`` runs token-id prompts greedily.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    if kw.get("kv_cache_memory_bytes"):
        # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (set by ENGINE_ENV) override an
        # explicit size (``CpuPlatform.check_and_update_config``)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = {**LLM_DEFAULTS, **kw}
    if kv_transfer_config is not None:
        cfg = dict(kv_transfer_config)
        cfg.setdefault("kv_role", "kv_both")
        args["kv_transfer_config"] = KVTransferConfig(**cfg)
    # vLLM runs three full garbage collections while it builds an engine (two as its worker
    # starts, one in EngineCore's freeze_gc_heap), each walking every object the imports made
    # (about 680k for vLLM, torch and transformers: 0.4 s a walk on 2 cores). Frozen first,
    # they are skipped, and a tiny engine starts in about 1 s instead of 2-2.5. Nothing stays
    # frozen for good: vLLM's shutdown (the worker's, EngineCore's) unfreezes all before it
    # collects.
    gc.freeze()
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
    """Free what an engine left behind so the next one starts clean.

    One full collection, ``cleanup_dist_env_and_memory``'s (it unfreezes the heap first): the
    engine's shutdown has already collected once, and each walk costs 0.4 s here.
    """
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


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


def generate_by_id(
    llm: Any,
    requests: Iterable[tuple[str, Sequence[int]]],
    max_tokens: int = 8,
    *,
    on_step: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Greedy-generate ``(request_id, prompt_token_ids)`` pairs; returns id -> RequestOutput.

    Drives ``llm.llm_engine`` step by step (``greedy`` goes through ``LLM.generate``), so the
    caller chooses the request ids (fault injection matches them) and can look at the
    scheduler after every step.
    """
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    for req_id, tokens in requests:
        eng.add_request(
            req_id, TokensPrompt(prompt_token_ids=list(tokens)), sampling_params(max_tokens)
        )
    outputs: dict[str, Any] = {}
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            return outputs
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
        if on_step is not None:
            on_step(llm)
    raise AssertionError("engine did not finish")
