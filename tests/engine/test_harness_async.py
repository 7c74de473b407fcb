"""The scheduler harness under async scheduling (``AsyncSchedulerHarness``), vLLM 0.32 and 0.33.

vLLM accepts a KV connector with async scheduling (no check in ``VllmConfig.__post_init__``
refuses the pair), but its CPU platform turns async scheduling off for engines
(``vllm/platforms/cpu.py``), so on this machine it is exercised at the scheduler level only.
"""

from __future__ import annotations

from pathlib import Path

from kvcompose.engine.harness import AsyncSchedulerHarness, SchedulerHarness
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prompt

BLOCK = 16


def test_the_cpu_platform_turns_async_scheduling_off_for_engines(tiny_model: Path) -> None:
    """Why the async path runs at the scheduler level only: asked for explicitly, with a
    connector, the config is accepted and the CPU platform sets ``async_scheduling`` False."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    script("async.only", Behaviour())
    ktc = KVTransferConfig(**kvcompose_config(chain("root", leaf("only", "async.only"))))
    args = EngineArgs(
        model=str(tiny_model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        num_gpu_blocks_override=64,
        max_model_len=128,
        kv_transfer_config=ktc,
        async_scheduling=True,
    )
    config = args.create_engine_config()
    assert config.kv_transfer_config is not None
    assert config.scheduler_config.async_scheduling is False


def _run(harness: type[SchedulerHarness], tiny_model: Path) -> tuple[SchedulerHarness, dict]:
    a = script("async.a", Behaviour(tokens=48, is_async=True, load_steps=2))
    script("async.b", Behaviour(delay_free=True, send_steps=2))
    tree = chain("root", leaf("a", "async.a"), leaf("b", "async.b"))
    h = harness(
        tiny_model,
        kvcompose_config(tree),
        block_size=BLOCK,
        num_blocks=64,
        max_model_len=256,
        with_worker=True,
    )
    h.add_request(prompt(80, seed=1), max_tokens=4, request_id="r1")
    h.add_request(prompt(40, seed=2), max_tokens=6, request_id="r2")
    h.run_until_idle(max_steps=60)
    assert a.recv_reports("r1") == [False]
    outputs = {rid: f.output_token_ids for rid, f in h.finished.items()}
    return h, outputs


def test_async_scheduling_runs_one_batch_ahead_with_a_composite(tiny_model: Path) -> None:
    """An AsyncScheduler with a kvcompose tree (an async load, a delayed free): the first
    step only schedules (its batch is fed back one step later), every request gets the
    same tokens as under the plain scheduler, and nothing is left behind."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    plain, expected = _run(SchedulerHarness, tiny_model)
    plain.assert_clean()
    plain.close()
    h, outputs = _run(AsyncSchedulerHarness, tiny_model)
    try:
        assert isinstance(h.scheduler, AsyncScheduler)
        assert h.vllm_config.scheduler_config.async_scheduling
        first, second = h.history[0], h.history[1]
        assert first.kv_connector_output is None and not first.engine_core_outputs
        assert second.kv_connector_output is not None, "batch 0 fed back in step 1"
        assert outputs == expected
        h.assert_clean()
    finally:
        h.close()
