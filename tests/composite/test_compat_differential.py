"""``kvcompose.compat.MultiConnector`` against vLLM's own ``MultiConnector``, call by call.

The same run under both — two recording ``ExampleConnector`` children ``a`` and ``b``; store
a prompt, reload it (``a`` owns), delete ``a``'s store, reload it again (``b`` owns) — and
each child's recorded calls (``kvcompose.testing.recording``) must be equal, except for what
``kvcompose.compat``'s docstring lists as different on purpose. Of those, only the worker's
KV-cache events call shows in such a run (plain synchronous children: no receives to filter,
no delayed frees, no stats); ``DOCUMENTED`` takes exactly that out, and only where upstream
never makes the call. The run is made twice: on vLLM's real scheduler (no model; the
children's stores are made by hand where the worker would have written them) and in a real
engine (the children store and load for real).
"""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcompose.testing import recording

BLOCK_SCHEDULER = 16
BLOCK_ENGINE = 32  # the CPU attention backend needs a multiple of 32

#: (role, method) calls compat makes and vLLM's MultiConnector does not, each listed in
#: ``kvcompose.compat``'s docstring.
DOCUMENTED = {("WORKER", "get_kv_connector_kv_cache_events")}


def multiconnector(tmp: Path, *, compat: bool) -> dict[str, Any]:
    children = [
        {
            "kv_connector": "RecordingExampleConnector",
            "kv_connector_module_path": recording.__name__,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp / n), "record_as": n},
        }
        for n in ("a", "b")
    ]
    config: dict[str, Any] = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": children},
    }
    if compat:
        config["kv_connector_module_path"] = "kvcompose.compat"
    return config


def compare(upstream: dict[str, recording.Log], compat: dict[str, recording.Log]) -> None:
    for name in ("a", "b"):
        assert not [e for e in upstream[name] if (e[0], e[1]) in DOCUMENTED], (
            "vLLM's MultiConnector now makes a call listed as a difference: update "
            "kvcompose.compat's docstring and DOCUMENTED"
        )
        mine = [e for e in compat[name] if (e[0], e[1]) not in DOCUMENTED]
        theirs = list(upstream[name])
        diff = "\n".join(
            line[:240]
            for line in difflib.unified_diff(
                [repr(e) for e in theirs],
                [repr(e) for e in mine],
                "MultiConnector",
                "compat",
                lineterm="",
            )
        )
        assert mine == theirs, f"child {name!r} was called differently:\n{diff}"


def lookups(log: recording.Log) -> list[tuple[Any, ...]]:
    """(request, answer) of every lookup, and the count each allocation told the child."""
    return [
        (method, args[0], args[-1] if method == "update_state_after_alloc" else result)
        for _, method, args, result in log
        if method in ("get_num_new_matched_tokens", "update_state_after_alloc")
    ]


def check_story(logs: dict[str, recording.Log], hit: int) -> None:
    """What the run is about, so that equal logs cannot both be wrong the same way."""
    assert lookups(logs["a"]) == [
        ("get_num_new_matched_tokens", "r0", (0, False)),
        ("update_state_after_alloc", "r0", 0),
        ("get_num_new_matched_tokens", "r1", (hit, False)),
        ("update_state_after_alloc", "r1", hit),  # a owns the reload
        ("get_num_new_matched_tokens", "r2", (0, False)),  # a's store is gone
        ("update_state_after_alloc", "r2", 0),
    ]
    assert lookups(logs["b"]) == [
        ("get_num_new_matched_tokens", "r0", (0, False)),
        ("update_state_after_alloc", "r0", 0),
        ("get_num_new_matched_tokens", "r1", (hit, False)),  # asked although a hit
        ("update_state_after_alloc", "r1", 0),
        ("get_num_new_matched_tokens", "r2", (hit, False)),
        ("update_state_after_alloc", "r2", hit),  # b owns
    ]
    for name in ("a", "b"):
        handshakes = [e for e in logs[name] if e[1] == "set_xfer_handshake_metadata_pp_aware"]
        assert handshakes == [("SCHEDULER", handshakes[0][1], (("dict", ()),), None)]


def take_logs() -> dict[str, recording.Log]:
    logs = {name: recording.LOGS[name] for name in ("a", "b")}
    recording.clear(["a", "b"])
    return logs


@pytest.mark.v033
def test_compat_calls_children_like_multiconnector_on_the_scheduler(
    harness_factory: Callable[..., Any], tmp_path: Path
) -> None:
    import torch

    def run(compat: bool) -> dict[str, recording.Log]:
        recording.clear(["a", "b"])
        tmp = tmp_path / ("compat" if compat else "upstream")
        h = harness_factory(
            multiconnector(tmp, compat=compat),
            block_size=BLOCK_SCHEDULER,
            enable_prefix_caching=False,
            with_worker=True,  # the worker half too, driven as the model runner drives it
        )
        prompt = h.make_prompt(40, seed=1)
        h.add_request(prompt)
        h.run_until_idle()
        # where each child's worker would have written the prompt (ExampleConnector keys
        # its store by the block-aligned prompt minus the last token)
        aligned = (len(prompt) - 1) // BLOCK_SCHEDULER * BLOCK_SCHEDULER
        for child in h.connector._connectors:
            child._generate_foldername_debug(torch.tensor(prompt[:aligned]), [], create_folder=True)
        h.add_request(prompt)
        h.run_until_idle()
        shutil.rmtree(tmp / "a")
        h.add_request(prompt)
        h.run_until_idle()
        h.close()
        return take_logs()

    upstream, compat = run(False), run(True)
    check_story(upstream, 32)
    compare(upstream, compat)


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_compat_calls_children_like_multiconnector_in_an_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    from kvcompose.engine.llm import greedy, make_llm

    prompt = [4 + (31 * i + (i * i) % 13) % 1000 for i in range(72)]

    def run(compat: bool) -> tuple[dict[str, recording.Log], list[list[int]]]:
        recording.clear(["a", "b"])
        tmp = tmp_path / ("compat" if compat else "upstream")
        outputs = []
        with make_llm(
            tiny_model,
            multiconnector(tmp, compat=compat),
            block_size=BLOCK_ENGINE,
            enable_prefix_caching=False,
            max_model_len=256,
        ) as llm:
            for turn in range(3):
                if turn == 2:
                    shutil.rmtree(tmp / "a")
                outputs += greedy(llm, [prompt], 2)
        return take_logs(), outputs

    (upstream, up_out), (compat, compat_out) = run(False), run(True)
    assert up_out == compat_out == [up_out[0]] * 3
    check_story(upstream, 64)
    compare(upstream, compat)
