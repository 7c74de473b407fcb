"""Fixtures for the PrefixStoreConnector tests: a tiny local Llama and engine helpers.

The shared ``kvcompose.testing.tiny_model.build_tiny_model`` is used when it exists;
otherwise a minimal local builder with the same shape is used (no downloads either way).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# Single-process engines (scheduler and worker in this process), quiet threads, offline.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: The CPU attention backend needs block sizes that are multiples of 32 (16 is rejected).
BLOCK_SIZE = 32
VOCAB = 1024


def _build_local_tiny_model(out_dir: Path) -> Path:
    """Fallback builder: LlamaForCausalLM, 2 layers, hidden 128, 4 heads of 32, vocab 1024."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = ("<pad>", "<s>", "</s>", "<unk>")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.2,  # outputs depend visibly on the KV cache
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i - len(specials)}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    try:
        from kvcompose.testing.tiny_model import build_tiny_model
    except ImportError:
        return _build_local_tiny_model(out)
    return Path(build_tiny_model(out))


def store_transfer_config(store: dict[str, Any], **top: Any):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="PrefixStoreConnector",
        kv_connector_module_path="kvcompose.stores",
        kv_role="kv_both",
        kv_connector_extra_config=store,
        **top,
    )


@contextlib.contextmanager
def engine(
    model_dir: Path,
    store: dict[str, Any] | None,
    *,
    enable_prefix_caching: bool = False,
    **top: Any,
) -> Iterator[Any]:
    """A single-process CPU engine with a PrefixStoreConnector (or none), torn down after."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if store is not None:
        kwargs["kv_transfer_config"] = store_transfer_config(store, **top)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        seed=0,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=enable_prefix_caching,
        **kwargs,
    )
    try:
        yield llm
    finally:
        # Shut the engine down now: the caller's ``as`` name keeps the LLM alive, and its
        # finalizer (which tears down vLLM's process groups) must not run later, while
        # the next engine is running.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def run(
    llm: Any,
    requests: Sequence[tuple[str, Sequence[int]]],
    *,
    max_tokens: int = 8,
    on_step: Callable[[int, Any], None] | None = None,
) -> dict[str, Any]:
    """Greedy-generate ``(request_id, prompt_token_ids)`` pairs; returns id -> RequestOutput.

    Drives ``llm.llm_engine`` step by step so tests choose the request ids (for fault
    injection) and can look at the scheduler between steps (``on_step(step_index, llm)``).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng = llm.llm_engine
    for req_id, tokens in requests:
        eng.add_request(req_id, TokensPrompt(prompt_token_ids=list(tokens)), params)
    outputs: dict[str, Any] = {}
    step = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
        if on_step is not None:
            on_step(step, llm)
        step += 1
        assert step < 10_000, "engine did not finish"
    return outputs


def token_ids(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _worker_stats(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return dict(get_kv_transfer_group().total_stats.data)


def worker_stats(llm: Any) -> dict[str, Any]:
    """Cumulative PrefixStoreConnector counters of the (single) worker."""
    return llm.collective_rpc(_worker_stats)[0]


def scheduler(llm: Any) -> Any:
    """The engine-core scheduler of a single-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler
