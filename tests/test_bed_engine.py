"""The engine bed is real: vLLM's ExampleConnector stores KV on disk, a fresh engine loads it
and produces the same greedy output; corrupting the stored tensors changes that output, so
the loaded KV is what the model attends to."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

MAX_TOKENS = 8


def _corrupt(files, seed: int = 1234) -> None:
    import safetensors.torch
    import torch

    gen = torch.Generator().manual_seed(seed)
    for f in files:
        tensors = safetensors.torch.load_file(str(f))
        noisy = {
            k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 4 for k, v in tensors.items()
        }
        safetensors.torch.save_file(noisy, str(f))


def test_example_connector_store_reload_and_negative_control(tiny_model, tmp_path):
    from kvcompose.testing.engine import (
        example_connector_config,
        example_prompts,
        greedy,
        make_llm,
        stored_files,
    )

    prompts = example_prompts(2, 200)
    cfg = example_connector_config(tmp_path / "store")

    with make_llm(tiny_model) as llm:  # no connector: the reference output
        reference = greedy(llm, prompts, MAX_TOKENS)

    with make_llm(tiny_model, cfg) as llm:  # stores
        stored_run = greedy(llm, prompts, MAX_TOKENS)
    files = stored_files(tmp_path / "store")
    # One directory per prompt, one file per layer (2 layers).
    assert len(files) == 2 * len(prompts)
    assert stored_run == reference

    with make_llm(tiny_model, cfg) as llm:  # a fresh engine loads
        outs = greedy(llm, prompts, MAX_TOKENS, return_outputs=True)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    # Block size 128 on CPU: the block-aligned part of prompt[:-1] is 128 of 200 tokens.
    assert [o.num_cached_tokens for o in outs] == [128, 128]

    _corrupt(files)
    with make_llm(tiny_model, cfg) as llm:  # loads the corrupted KV
        outs = greedy(llm, prompts, MAX_TOKENS, return_outputs=True)
    assert [o.num_cached_tokens for o in outs] == [128, 128]
    corrupted = [list(o.outputs[0].token_ids) for o in outs]
    assert corrupted != reference, "outputs ignored the loaded KV"


def test_engines_run_back_to_back_in_one_process(tiny_model):
    """make_llm tears an engine down so the next starts cleanly (the suite relies on it)."""
    from kvcompose.testing.engine import example_prompts, greedy, make_llm

    prompts = example_prompts(1, 40)
    with make_llm(tiny_model) as llm:
        first = greedy(llm, prompts, 4)
    with make_llm(tiny_model, max_model_len=512) as llm:
        second = greedy(llm, prompts, 4)
    assert first == second and len(first[0]) == 4
