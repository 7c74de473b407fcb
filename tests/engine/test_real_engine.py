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
    from kvcompose.testing.real_engine import (
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
    from kvcompose.testing.real_engine import example_prompts, greedy, make_llm

    prompts = example_prompts(1, 40)
    with make_llm(tiny_model) as llm:
        first = greedy(llm, prompts, 4)
    with make_llm(tiny_model, max_model_len=512) as llm:
        second = greedy(llm, prompts, 4)
    assert first == second and len(first[0]) == 4


def _report_and_print(llm, n: int) -> str:
    from kvcompose.engine.process import report_progress

    for i in range(n):
        report_progress(step=i)
    print("a line from the engine process", flush=True)
    return type(llm).__name__


def _fail(llm) -> None:
    raise ValueError("boom from the engine")


def _core_class(llm) -> str:
    from kvcompose.engine.probe import engine_core, scheduler_connector

    assert scheduler_connector(llm) is None  # no connector configured
    return type(engine_core(llm)).__name__


def test_engine_process_reports_progress_logs_and_errors(tiny_model, tmp_path):
    """The one child-process engine runner: calls run in the child, progress reaches the
    parent during the call, the child's output goes to its log, errors come back typed."""
    from kvcompose.engine.process import EngineError, EngineProcess

    seen: list[dict] = []
    log = tmp_path / "run" / "engine.log"
    with EngineProcess(
        tiny_model,
        name="bed",
        log_file=log,
        on_progress=seen.append,
        llm_kwargs={"max_model_len": 512},
    ) as proc:
        assert proc.info["pid"] != __import__("os").getpid()
        assert proc.call(_report_and_print, 3) == "LLM"
        assert seen == [{"step": 0}, {"step": 1}, {"step": 2}]
        with pytest.raises(EngineError) as err:
            proc.call(_fail)
        assert err.value.summary == "ValueError: boom from the engine"
        assert proc.call(_core_class) == "EngineCore"  # the engine still serves
    text = log.read_text()
    assert "a line from the engine process" in text and "boom from the engine" in text


def _named_semaphores(llm) -> int:
    """Named semaphores this process made and would unlink at a normal exit."""
    from multiprocessing import synchronize, util

    cleanup = synchronize.SemLock._cleanup
    return sum(
        getattr(f, "_callback", None) is cleanup for f in list(util._finalizer_registry.values())
    )


def test_an_engine_ended_at_once_leaves_no_named_semaphore(tiny_model):
    """The bench ends its engines with SIGTERM (``close(graceful=False)``), which skips a
    child's exit handlers. tqdm's multiprocessing lock for the weight-loading bar was such a
    named semaphore: never unlinked, one per engine, which the resource tracker reported as
    "leaked semaphore objects" when the bench exited. Started with ``wait=False``, as engines
    that start side by side are: the first call waits for the engine."""
    from kvcompose.engine.process import EngineProcess

    proc = EngineProcess(tiny_model, preloaded=True, llm_kwargs={"max_model_len": 256}, wait=False)
    try:
        assert proc.info is None
        assert proc.generate([[5, 6, 7, 8]], 2)[0][0]
        assert proc.info is not None and proc.info["pid"] == proc.wait_started()["pid"]
        assert proc.call(_named_semaphores) == 0
    finally:
        proc.close(graceful=False)
