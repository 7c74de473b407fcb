"""Prefill/decode over real NIXL on the hybrid model (2 KV cache groups: layers 0 and 2 slide
over 64 tokens), with the trees of ``examples/pd`` on both engines under ``KVComposeHMA``.

P runs ``chain/first[nixl, disk]`` (``kv_producer``), D ``chain/first[disk, nixl]``
(``kv_consumer``, its disk tier ``kv_both``), rendered from the example's files with their
store directories moved under the test's temporary directory. Both engines keep vLLM's hybrid
KV cache manager on (2 groups, as many blocks as without a connector). The reference is one
engine without a connector. A cold D pulls every group from P over NIXL: the full-attention
group's 7 blocks of a 200-token prompt and the sliding group's 3 window blocks. A D whose disk
tier holds the prompt loads it from there and NIXL moves nothing. Noise written into P's
blocks before D reads them changes D's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pd_scenarios import (
    BLOCK,
    LLM_KWARGS,
    PROMPT_LEN,
    assert_clean,
    assert_crossed,
    assert_p_freed_fast,
    handoff,
    prompt,
    seed_disk,
)

from kvcompose.config import load_config
from kvcompose.config.render import vllm_args
from kvcompose.engine.probe import kv_cache_facts
from kvcompose.testing import pd
from kvcompose.testing.pd import EngineProcess
from kvcompose.testing.ports import free_port

pytestmark = [pytest.mark.engine, pytest.mark.pd, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pd"
SEEDS = (60, 61, 62)
D_TOKENS = 24  # long enough that "P freed before D's request ended" is not a race (pd_scenarios)
WINDOW = 64
#: one block of one group: 2 layers of K and V, 4 heads of 32, float32
GROUP_BLOCK = 2 * 2 * BLOCK * 4 * 32 * 4
FULL_BLOCKS = -(-PROMPT_LEN // BLOCK)  # 7
#: the sliding group's blocks vLLM allocates for 200 tokens: the window before the last
SLIDING_BLOCKS = FULL_BLOCKS - (PROMPT_LEN - WINDOW + 1) // BLOCK  # 3


@dataclass
class Bed:
    prefill: EngineProcess
    decode: EngineProcess
    ref: dict[int, list[int]]
    facts: dict[str, dict[str, Any]]  # kv_cache_facts of the reference, P and D


def example_config(name: str, stores: Path) -> dict[str, Any]:
    """An example file rendered for vLLM (``hma: auto`` asks vLLM which children support
    HMA), its store directory moved under ``stores``."""
    config = vllm_args(load_config(str(EXAMPLE / name), env={}, check_vllm=True))

    def move(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: str(stores / Path(v).name) if k == "path" else move(v) for k, v in node.items()
            }
        if isinstance(node, list):
            return [move(v) for v in node]
        return node

    return move(config)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    pytest.importorskip("nixl")
    from kvcompose.engine.llm import greedy, make_llm
    from kvcompose.engine.model import tiny_hybrid_model

    model = tiny_hybrid_model()
    stores = tmp_path_factory.mktemp("pd-hybrid")
    p_cfg, d_cfg = (example_config(n, stores) for n in ("prefill.yaml", "decode.yaml"))
    assert p_cfg["kv_connector"] == d_cfg["kv_connector"] == "KVComposeHMA"
    engines = []
    try:
        for name, cfg in (("prefill", p_cfg), ("decode", d_cfg)):
            engines.append(
                EngineProcess(
                    model,
                    cfg,
                    name=f"{name}-hybrid",
                    llm_kwargs=LLM_KWARGS,
                    env=pd.engine_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
                    preloaded=True,
                    wait=False,
                )
            )
        # the reference engine runs here while the pair starts (side by side)
        with make_llm(model, **LLM_KWARGS) as llm:
            outs = greedy(llm, [prompt(s) for s in SEEDS], D_TOKENS)
            facts = {"reference": kv_cache_facts(llm)}
        p, d = engines
        for engine in engines:
            engine.wait_started()
            engine.call(pd.trace_on)
        facts.update(prefill=p.call(kv_cache_facts), decode=d.call(kv_cache_facts))
        yield Bed(p, d, dict(zip(SEEDS, outs, strict=True)), facts)
    finally:
        for engine in reversed(engines):
            engine.close(graceful=False)


def test_both_engines_keep_hma_on_with_the_example_trees(bed: Bed) -> None:
    ref = bed.facts["reference"]
    assert sorted(ref["groups"]) == ["FullAttentionSpec", "SlidingWindowSpec"] and ref["hma"]
    assert bed.facts["prefill"] == bed.facts["decode"] == ref


def test_a_cold_decode_pulls_every_group_over_nixl(bed: Bed) -> None:
    p, d = bed.prefill, bed.decode
    handoff(p, d, prompt(1), D_TOKENS)  # the NIXL handshake, out of the measurement
    h = handoff(p, d, prompt(SEEDS[0]), D_TOKENS)
    assert h.d_tokens == bed.ref[SEEDS[0]], h.row()
    assert_crossed(h)
    # the full group's 7 blocks and the sliding group's 3 window blocks, once each
    assert h.bytes_moved == (FULL_BLOCKS + SLIDING_BLOCKS) * GROUP_BLOCK, h.row()
    assert_p_freed_fast(h)
    assert_clean(p, d)


def test_the_decode_disk_tier_serves_both_groups_and_frees_p(bed: Bed) -> None:
    p, d = bed.prefill, bed.decode
    seed_disk(d, prompt(SEEDS[1]))
    h = handoff(p, d, prompt(SEEDS[1]), D_TOKENS)
    assert h.d_tokens == bed.ref[SEEDS[1]], h.row()
    full_prefix = (PROMPT_LEN - 1) // BLOCK * BLOCK
    assert h.owner == "disk" and h.allocs == {"disk": full_prefix, "nixl": 0}, h.row()
    assert h.bytes_moved == 0, h.row()
    assert_p_freed_fast(h)  # NIXL, told 0, tells P to free at once
    assert_clean(p, d)


def test_noise_in_p_blocks_changes_d_output(bed: Bed) -> None:
    p, d = bed.prefill, bed.decode
    h = handoff(p, d, prompt(SEEDS[2]), D_TOKENS, corrupt_p=True)
    assert_crossed(h)
    assert h.d_tokens != bed.ref[SEEDS[2]], h.row()
    assert_clean(p, d)
