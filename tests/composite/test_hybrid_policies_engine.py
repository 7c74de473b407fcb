"""Every chain policy, fan-out, route, promotion, admission and fallback on one real engine
with the hybrid model (2 KV cache groups: layers 0 and 2 slide over 64 tokens, layers 1 and
3 attend fully; blocks of 32 tokens) under ``KVComposeHMA``.

One engine serves the whole module: its root is a ``route`` that sends each request's lookup
to the subtree its ``kv_transfer_params`` name (``{"tree": <child>}``), so every policy is a
subtree over the same store directories. Saving is not routed: every leaf hears every
request, and the leaves that save admit only the requests that say so (``admit_when``), so
the two filling leaves write tier ``a`` and tier ``b`` on request.

- Tier ``a`` holds the first 160 tokens of prompt ``p1`` and the first 64 of ``p2``; tier
  ``b`` both prompts' 192 (what a store can offer of 200 tokens).
- The reference is recompute: the filling requests find nothing stored (0 cached tokens),
  and their greedy outputs are what every load must reproduce.
- A load of ``n`` tokens restores blocks ``[0, n/32)`` of the full-attention group and, of
  the sliding group, only the blocks vLLM allocated there: the window before ``n``
  (``SlidingWindowManager.get_num_skipped_tokens``: ``n - 64 + 1`` tokens skipped).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcompose.engine.probe import scheduler
from kvcompose.introspect import scheduler_connector
from kvcompose.stores import PrefixStoreConnector, store_usage
from kvcompose.testing import faulty_store, pd
from kvcompose.testing.real_engine import make_llm
from kvcompose.testing.scripted import Behaviour, leaf, script
from kvcompose.testing.trees import chain, kvcompose_config, prefix_store_leaf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

BLOCK = 32
WINDOW = 64
#: bytes of one block of one layer: K and V, 4 heads of 32, float32
LAYER_BLOCK = 2 * BLOCK * 4 * 32 * 4
LAYERS_PER_GROUP = 2
PROMPT = 200
FULL = (PROMPT - 1) // BLOCK * BLOCK  # 192: what a store offers of a 200-token prompt
A_P1, A_P2 = 160, 64  # what tier a holds of p1 and p2
MAX_TOKENS = 6
#: the request ids whose loads the faulty copy of tier b fails
FAILS = ("fails", "fails2")


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    return [4 + (97 * seed + 13 * i + (i * i) % 7) % 1000 for i in range(n)]


P1, P2, P3, P4 = (prompt(s) for s in (1, 2, 3, 4))
SHORT = prompt(5, 20)  # shorter than a block: nothing to look up or save


def store(name: str, path: Path, **extra: Any) -> dict[str, Any]:
    return prefix_store_leaf(name, path, **extra)


def read(name: str, path: Path, **fields: Any) -> dict[str, Any]:
    return prefix_store_leaf(name, path, read_only=True, fields=fields or None)


def the_tree(d: dict[str, Path]) -> dict[str, Any]:
    """The route over every subtree the module's tests use (see the module docstring)."""
    faulty = {
        "connector": faulty_store.CONNECTOR,
        "module_path": faulty_store.MODULE_PATH,
        "load_range": "native",
    }
    prior = {"expect_read": {"latency_ms": 1.0, "gbps": 1.0}}
    subtrees = [
        store("fill_a", d["a"], admit_when={"param": "fill", "equals": "a"}),
        store("fill_b", d["b"], admit_when={"param": "fill", "equals": "b"}),
        chain("first", read("first_a", d["a"]), read("first_b", d["b"]), policy="first"),
        chain("longest", read("longest_a", d["a"]), read("longest_b", d["b"]), policy="longest"),
        chain("stitch", read("stitch_a", d["a"]), read("stitch_b", d["b"]), policy="stitch"),
        chain(
            "fastest",
            read("fastest_a", d["a"], **prior),
            read("fastest_b", d["b"], **prior),
            policy="fastest",
        ),
        # tier a's copy with noise in its sliding layers (the stitch's negative control)
        chain("noisy", read("noisy_a", d["noisy_a"]), read("noisy_b", d["b"]), policy="stitch"),
        {
            "kind": "fanout",
            "name": "fanout",
            "load_from": "mirror_1",
            "children": [
                store("mirror_1", d["m1"], admit_when={"param": "mirror"}),
                store("mirror_2", d["m2"], admit_when={"param": "mirror"}),
            ],
        },
        # a small tier that admits only kept requests, and promotes what tier b loads
        chain(
            "promote",
            store("small", d["small"], promote=True, admit_when={"param": "keep"}),
            read("promote_b", d["b"]),
        ),
        read("small_only", d["small"]),
        # tier b's copy fails FAILS's loads; tier a holds a shorter prefix
        chain(
            "fallback",
            prefix_store_leaf(
                "broken_b",
                d["broken_b"],
                read_only=True,
                fields=faulty,
                fail_load_request_ids=list(FAILS),
            ),
            read("fallback_a", d["a"]),
            policy="longest",
        ),
        # holds nothing, loads nothing: the zero-token case, and a witness of every finish
        leaf("empty", connector="ScriptedHMAConnector", load_range="native"),
    ]
    names = [t["name"] for t in subtrees]
    return {
        "kind": "route",
        "name": "policies",
        "default": "empty",
        "rules": [{"param": "tree", "equals": n, "child": n} for n in names],
        "children": subtrees,
    }


@dataclass
class Bed:
    llm: Any
    dirs: dict[str, Path]
    ref: dict[str, list[int]]  # greedy outputs of recompute, by prompt name
    sliding: int  # the sliding group's index
    empty: Any  # the scripted HMA leaf's script (its calls)
    finishes: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)

    def ask(
        self, tree: str, prompts: dict[str, list[int]], **params: Any
    ) -> dict[str, dict[str, Any]]:
        """Run ``prompts`` (request id -> tokens) through subtree ``tree``."""
        ids = list(prompts)
        outs = pd.run_requests(
            self.llm,
            [prompts[r] for r in ids],
            MAX_TOKENS,
            {"tree": tree, **params},
            request_ids=ids,
        )
        return dict(zip(ids, outs, strict=True))

    def totals(self) -> dict[str, dict[str, Any]]:
        return pd.store_totals(self.llm)

    def live(self) -> dict[str, Any]:
        return pd.kvcompose_live(self.llm)


def loaded_blocks(after: dict[str, Any], before: dict[str, Any], sliding: int) -> dict[str, int]:
    """Blocks a store loaded between two ``store_totals`` readings, per group."""
    out = {}
    for kind, g in (("full", 1 - sliding), ("sliding", sliding)):
        key = f"bytes_loaded_group{g}"
        moved = after.get(key, 0) - before.get(key, 0)
        out[kind] = moved // (LAYER_BLOCK * LAYERS_PER_GROUP)
    return out


def window_blocks(n: int) -> int:
    """The sliding group's blocks vLLM allocates for a load of ``n`` tokens (block-aligned)."""
    return n // BLOCK - (n - WINDOW + 1) // BLOCK


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    from kvcompose.engine.model import tiny_hybrid_model

    root = tmp_path_factory.mktemp("hybrid-policies")
    names = ("a", "b", "noisy_a", "m1", "m2", "small", "broken_b")
    dirs = {n: root / n for n in names}
    for p in dirs.values():
        p.mkdir()
    finishes: list[tuple[int, str, tuple[int, ...]]] = []
    original = PrefixStoreConnector.request_finished_all_groups

    def recording(self: Any, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        finishes.append((id(self), request.request_id, tuple(len(g) for g in block_ids)))
        return original(self, request, block_ids)

    empty = script("empty", Behaviour(tokens=0))
    cfg = kvcompose_config(the_tree(dirs), kv_load_failure_policy="recompute")
    cfg["kv_connector"] = "KVComposeHMA"
    with contextlib.ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        # the composite binds each child's finish when it is built: patch the class first
        mp.setattr(PrefixStoreConnector, "request_finished_all_groups", recording)
        llm = stack.enter_context(
            make_llm(tiny_hybrid_model(), cfg, block_size=BLOCK, enable_prefix_caching=False)
        )
        groups = scheduler(llm).kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"]
        bed = Bed(llm, dirs, {}, kinds.index("SlidingWindowSpec"), empty, finishes)
        # fill: tier b with both prompts, tier a with their shorter prefixes
        filled = {
            **bed.ask("fill_b", {"p1": P1, "p2": P2, "p3": P3, "p4": P4}, fill="b"),
            **bed.ask("fill_a", {"p1-a": P1[: A_P1 + 10], "p2-a": P2[: A_P2 + 6]}, fill="a"),
        }
        assert all(out["num_cached_tokens"] == 0 for out in filled.values()), "recompute"
        bed.ref.update({k: filled[k]["token_ids"] for k in ("p1", "p2", "p3", "p4")})
        assert store_usage(dirs["b"])["files"] == 4 * FULL // BLOCK
        assert store_usage(dirs["a"])["files"] == (A_P1 + A_P2) // BLOCK
        shutil.copytree(dirs["a"], dirs["noisy_a"], dirs_exist_ok=True)
        shutil.copytree(dirs["b"], dirs["broken_b"], dirs_exist_ok=True)
        yield bed


def test_first_longest_and_fastest_load_each_group_of_their_hit(bed: Bed) -> None:
    before = bed.totals()
    first = bed.ask("first", {"first-p1": P1})["first-p1"]
    longest = bed.ask("longest", {"longest-p1": P1})["longest-p1"]
    fastest = bed.ask("fastest", {"fastest-p1": P1})["fastest-p1"]
    after = bed.totals()
    for out in (first, longest, fastest):
        assert out["token_ids"] == bed.ref["p1"]
    # first: tier a answers first; longest and fastest: tier b's longer hit
    assert first["num_cached_tokens"] == A_P1
    assert longest["num_cached_tokens"] == fastest["num_cached_tokens"] == FULL
    blocks = {p: loaded_blocks(after[p], before.get(p, {}), bed.sliding) for p in after}
    assert blocks["first/first_a"] == {"full": A_P1 // BLOCK, "sliding": window_blocks(A_P1)}
    assert blocks["first/first_b"] == {"full": 0, "sliding": 0}
    assert blocks["longest/longest_b"] == {"full": FULL // BLOCK, "sliding": window_blocks(FULL)}
    assert blocks["longest/longest_a"] == {"full": 0, "sliding": 0}
    # fastest: at equal priors tier b's whole hit, one latency; the store reads its async
    # loads (on 2 groups) one after the other, so a stitch from a would pay a second one
    assert blocks["fastest/fastest_b"] == blocks["longest/longest_b"]
    assert blocks["fastest/fastest_a"] == {"full": 0, "sliding": 0}
    assert bed.live() == {}


def test_a_stitch_restores_each_window_block_from_the_segment_that_holds_it(bed: Bed) -> None:
    """The rule: each segment's child restores, per group, the blocks vLLM allocated inside
    its own range. For the sliding group that is the part of the window before the stitch's
    end that falls in its range: a segment wholly before the window restores the
    full-attention group only, and a window that crosses a segment boundary is restored by
    both segments' children, each its own blocks."""
    before = bed.totals()
    outs = bed.ask("stitch", {"stitch-p1": P1, "stitch-p2": P2})
    after = bed.totals()
    assert outs["stitch-p1"]["token_ids"] == bed.ref["p1"]
    assert outs["stitch-p2"]["token_ids"] == bed.ref["p2"]
    assert outs["stitch-p1"]["num_cached_tokens"] == outs["stitch-p2"]["num_cached_tokens"] == FULL
    a = loaded_blocks(after["stitch/stitch_a"], before.get("stitch/stitch_a", {}), bed.sliding)
    b = loaded_blocks(after["stitch/stitch_b"], before.get("stitch/stitch_b", {}), bed.sliding)
    # p1: a [0, 160), b [160, 192). The window before 192 is blocks 4 and 5: a restores
    # block 4 of both groups, b block 5 of both.
    # p2: a [0, 64), b [64, 192). The window is wholly in b's segment: a restores only the
    # full-attention group.
    assert a == {"full": A_P1 // BLOCK + A_P2 // BLOCK, "sliding": 1 + 0}
    assert b == {"full": 1 + (FULL - A_P2) // BLOCK, "sliding": 1 + 2}
    assert bed.live() == {}


def test_noise_in_the_earlier_segments_sliding_layers_matters_only_inside_the_window(
    bed: Bed,
) -> None:
    """Negative control of the rule above: noise in every sliding layer of tier a's copy
    changes p1's output (a's segment holds window block 4) and leaves p2's alone (a's
    segment ends before the window: its sliding blocks are never read)."""
    sliding_layers = {
        name
        for g in scheduler(bed.llm).kv_cache_config.kv_cache_groups
        if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"
        for name in g.layer_names
    }
    assert _noise(bed.dirs["noisy_a"], sliding_layers) == (A_P1 + A_P2) // BLOCK
    outs = bed.ask("noisy", {"noisy-p1": P1, "noisy-p2": P2})
    assert outs["noisy-p1"]["num_cached_tokens"] == outs["noisy-p2"]["num_cached_tokens"] == FULL
    assert outs["noisy-p1"]["token_ids"] != bed.ref["p1"]
    assert outs["noisy-p2"]["token_ids"] == bed.ref["p2"]


def _noise(path: Path, layers: set[str]) -> int:
    """Overwrite ``layers``' tensors in every chunk file under ``path`` with noise."""
    import safetensors.torch
    import torch

    g = torch.Generator().manual_seed(0)
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(str(f))
        hit = [k for k in tensors if k in layers]
        assert hit, f"no sliding layer in {f.name}: {sorted(tensors)}"
        for k in hit:
            tensors[k] = torch.randn(tensors[k].shape, generator=g).to(tensors[k].dtype) * 5
        safetensors.torch.save_file(tensors, str(f))
        n += 1
    return n


def test_fanout_saves_every_group_to_both_mirrors_and_loads_from_one(bed: Bed) -> None:
    before = bed.totals()
    saved = bed.ask("fanout", {"mirror-p3": P3}, mirror=True)["mirror-p3"]
    assert saved["token_ids"] == bed.ref["p3"] and saved["num_cached_tokens"] == 0
    middle = bed.totals()
    for name in ("fanout/mirror_1", "fanout/mirror_2"):
        s = {k: middle[name].get(k, 0) - before.get(name, {}).get(k, 0) for k in middle[name]}
        # every block of both groups: 6 chunks of 2 layers per group
        per_group = FULL // BLOCK * LAYER_BLOCK * LAYERS_PER_GROUP
        assert s["bytes_saved_group0"] == s["bytes_saved_group1"] == per_group, name
    again = bed.ask("fanout", {"mirror-p3-again": P3})["mirror-p3-again"]
    assert again["token_ids"] == bed.ref["p3"] and again["num_cached_tokens"] == FULL
    after = bed.totals()
    assert loaded_blocks(after["fanout/mirror_1"], middle["fanout/mirror_1"], bed.sliding) == {
        "full": FULL // BLOCK,
        "sliding": window_blocks(FULL),
    }
    assert loaded_blocks(after["fanout/mirror_2"], middle["fanout/mirror_2"], bed.sliding) == {
        "full": 0,
        "sliding": 0,
    }


def test_promotion_and_admission_on_two_groups(bed: Bed) -> None:
    """Admission keeps what it should out and lets a kept request in, every group of it.
    Promotion under HMA copies only the window: after tier b's load of 192 tokens the
    sliding group holds blocks 4 and 5 only (vLLM never allocated the others), so the small
    tier can store only chunks 4 and 5, a chain no lookup reaches from the prompt's start:
    the small tier then serves nothing of p4, and p4 is recomputed."""
    small = bed.dirs["small"]
    kept = prompt(12)
    bed.ask("promote", {"promote-miss": prompt(9)})
    assert store_usage(small)["files"] == 0  # not kept, nothing loaded
    bed.ask("promote", {"promote-kept": kept}, keep=True)
    assert store_usage(small)["files"] == FULL // BLOCK
    out = bed.ask("promote", {"promote-p4": P4})["promote-p4"]
    assert out["token_ids"] == bed.ref["p4"] and out["num_cached_tokens"] == FULL
    assert store_usage(small)["files"] == FULL // BLOCK + window_blocks(FULL)
    served = bed.ask("small_only", {"small-p4": P4, "small-kept": kept})
    assert served["small-p4"]["token_ids"] == bed.ref["p4"]
    assert served["small-p4"]["num_cached_tokens"] == 0
    assert served["small-kept"]["num_cached_tokens"] == FULL


def test_a_failed_load_under_the_route_is_recomputed(bed: Bed) -> None:
    before = bed.totals()
    out = bed.ask("fallback", {FAILS[0]: P1})[FAILS[0]]
    after = bed.totals()
    assert out["token_ids"] == bed.ref["p1"]
    path = "fallback/broken_b"
    assert after[path]["load_failures"] - before.get(path, {}).get("load_failures", 0) == 1
    assert bed.live() == {}


def test_a_failed_load_falls_back_to_the_nested_chains_next_child(bed: Bed) -> None:
    before = bed.totals()
    out = bed.ask("fallback", {FAILS[1]: P1})[FAILS[1]]
    after = bed.totals()
    assert out["token_ids"] == bed.ref["p1"]
    served = loaded_blocks(
        after["fallback/fallback_a"], before.get("fallback/fallback_a", {}), bed.sliding
    )
    assert served == {"full": A_P1 // BLOCK, "sliding": window_blocks(A_P1)}


def test_zero_tokens_and_every_finish_reach_every_hma_child_with_both_groups(bed: Bed) -> None:
    """A prompt shorter than a block through every subtree, and a prompt no tier holds: no
    load, no save, outputs of recompute; every store heard every finish with both groups'
    block ids, and so did the scripted HMA leaf."""
    trees = ("first", "longest", "stitch", "fastest", "fanout", "promote", "fallback")
    del bed.finishes[:]
    before = bed.totals()
    outs = {}
    for t in trees:
        outs.update(bed.ask(t, {f"short-{t}": SHORT, f"miss-{t}": prompt(11)}))
    after = bed.totals()
    short = {o["token_ids"][0] for k, o in outs.items() if k.startswith("short")}
    miss = [o["token_ids"] for k, o in outs.items() if k.startswith("miss")]
    assert len(short) == 1 and all(m == miss[0] for m in miss)
    assert all(o["num_cached_tokens"] == 0 for o in outs.values())
    for path, totals in after.items():
        was = before.get(path, {})
        assert totals.get("bytes_loaded", 0) == was.get("bytes_loaded", 0), path
    tree = pd.scheduler_connectors(bed.llm).values()
    stores = [c for c in tree if isinstance(c, PrefixStoreConnector)]
    heard: dict[int, set[str]] = {}
    for who, req_id, groups in bed.finishes:
        assert len(groups) == 2, (req_id, groups)
        heard.setdefault(who, set()).add(req_id.rsplit("-", 1)[0])
    assert {id(s) for s in stores} == set(heard)
    assert all(ids == set(outs) for ids in heard.values())
    calls = bed.empty.calls
    assert {c[1].rsplit("-", 1)[0] for c in calls if c[0] == "finished_groups"} >= set(outs)
    assert all(c[2] == 2 for c in calls if c[0] == "finished_groups")
    assert bed.live() == {}
    assert scheduler_connector(bed.llm).live_requests() == {}
