"""The store's scheduler half under 2 KV cache groups, without an engine: where a load after
a local hit puts each group's blocks (a sliding group's nulls skipped, the file offset moved
past them), and that a chunk with a null block in any group is not saved."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvcompose.stores import PrefixStoreConfig, chunk_keys
from kvcompose.stores.prefix.files import ChunkFiles
from kvcompose.stores.prefix.groups import NULL_BLOCK_ID, KVGroups, window_blocks
from kvcompose.stores.prefix.keys import request_salt
from kvcompose.stores.prefix.scheduler import PrefixStoreScheduler

BS = 32
#: Group 0 slides (its blocks behind the window are null), group 1 is full attention.
GROUPS = KVGroups({"sliding": 0, "full": 1}, (True, False))
N = NULL_BLOCK_ID


class Blocks:
    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.groups)


def _request(tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id="r", prompt_token_ids=tokens, mm_features=[], lora_request=None, cache_salt=None
    )


def _scheduler(tmp_path: Path, **config: Any) -> PrefixStoreScheduler:
    return PrefixStoreScheduler(
        PrefixStoreConfig(path=str(tmp_path), **config),
        ChunkFiles(str(tmp_path), [""]),
        block_size=BS,
        salt="salt",
        loads_enabled=True,
        saves_enabled=True,
        groups=GROUPS,
    )


def _output(*new: Any, scheduled: int = 0) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={"r": scheduled} if scheduled else {},
        total_num_scheduled_tokens=scheduled,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def _stored(s: PrefixStoreScheduler, req: Any, n: int) -> list[str]:
    keys = chunk_keys(req.prompt_token_ids, s.chunk_tokens, request_salt(s.salt, req))
    for key in keys[:n]:
        open(s.files.file(key), "wb").close()
    return keys


def test_window_blocks_skips_the_nulls_before_the_window() -> None:
    assert window_blocks([N, N, 7, 8]) == (2, [7, 8])
    assert window_blocks([5, 6]) == (0, [5, 6])
    assert window_blocks([N]) == (1, [])


def test_load_after_a_local_hit_places_each_group(tmp_path: Path) -> None:
    s = _scheduler(tmp_path, chunk_blocks=2)  # chunks of 64 tokens
    req = _request(list(range(500, 800)))
    keys = _stored(s, req, 3)  # 192 tokens stored
    # vLLM's local hit is 32 tokens; the store adds [32, 192). With 192 tokens computed and
    # a window of 96, vLLM keeps the sliding group's blocks 3 to 5 only (tokens 96..191).
    assert s.get_num_new_matched_tokens(req, 32) == (160, True)  # async: 2 groups
    sliding = [N, N, N, 23, 24, 25, 26]
    full = [10, 11, 12, 13, 14, 15, 16]
    s.update_state_after_alloc(req, Blocks(sliding, full), 160)
    (load,) = s.build_connector_meta(_output()).loads
    assert load.is_async and load.num_tokens == 160
    assert [(c.key, c.groups) for c in load.chunks] == [
        (keys[0], [(2, []), (1, [11])]),  # chunk 0 from its block 1; no sliding block
        (keys[1], [(1, [23]), (0, [12, 13])]),  # the sliding part from the file's block 1
        (keys[2], [(0, [24, 25]), (0, [14, 15])]),
    ]
    # Group 0's part stands for the chunk where one group is assumed.
    assert (load.chunks[1].first_block, load.chunks[1].block_ids) == (1, [23])


def test_a_chunk_with_a_null_block_in_a_group_is_not_saved(tmp_path: Path) -> None:
    s = _scheduler(tmp_path)
    tokens = list(range(900, 1000))  # 3 full chunks of 32
    req = _request(tokens)
    s.update_state_after_alloc(req, Blocks([N, 31, 32, 33], [40, 41, 42, 43]), 0)
    new = SimpleNamespace(
        req_id="r",
        prompt_token_ids=tokens,
        block_ids=([N, 31, 32, 33], [40, 41, 42, 43]),
        num_computed_tokens=0,
    )
    meta = s.build_connector_meta(_output(new, scheduled=100))
    keys = chunk_keys(tokens, BS, request_salt(s.salt, req))
    assert [(x.key, x.groups) for x in meta.saves] == [
        (keys[1], [[31], [41]]),
        (keys[2], [[32], [42]]),
    ]
