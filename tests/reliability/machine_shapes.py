"""The tree shapes the randomized machine runs (``SHAPES``) and the sizes it draws within."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcompose.testing.scripted import leaf
from kvcompose.testing.trees import chain

BLOCK = 16
MAX_MODEL_LEN = 128
MAX_PROMPT = 96
MAX_OUTPUT = 24
#: A lookup that stays ``None`` "forever" (only drawn when the node deadline is 0 s).
FOREVER = 10**9
#: The sliding window of the 2-group shapes' model (two blocks).
SLIDING_WINDOW = 2 * BLOCK


@dataclass(frozen=True)
class Shape:
    """A tree shape: its leaves and how to build it for a given lookup deadline."""

    name: str
    leaves: tuple[str, ...]
    build: Callable[[float], dict[str, Any]]
    #: ``kv_transfer_params`` a request may carry (route rules read them).
    params: tuple[dict[str, Any] | None, ...] = (None,)
    #: Draw hits mostly on block boundaries, so that later children can stitch after them.
    aligned: bool = False
    #: KV cache groups: 2 is the tiny model made hybrid (a sliding-window group of
    #: ``SLIDING_WINDOW`` tokens and a full-attention group) under ``KVComposeHMA``.
    groups: int = 1


def script_name(leaf_name: str) -> str:
    return f"rel.{leaf_name}"


def _leaf(name: str, **fields: Any) -> dict[str, Any]:
    return leaf(name, script_name(name), **fields)


def _hma(name: str, **fields: Any) -> dict[str, Any]:
    """A scripted leaf that supports HMA; ``native`` ones can be parked (their sync loads
    told to vLLM as async, so that a failure can go up by request)."""
    return _leaf(name, connector="ScriptedHMAConnector", **fields)


def _hma_chain(t: float) -> dict[str, Any]:
    """root = chain[first](a, b native), on 2 KV cache groups: every sync load is parked."""
    native = {"load_range": "native"}
    return chain(
        "root", _hma("a", **native), _hma("b", **native), policy="first", lookup_timeout_s=t
    )


def _hma_stitch(t: float) -> dict[str, Any]:
    """root = chain[stitch](a, b, c native; d sole owner, which cannot be parked: its sync
    hits are not taken), on 2 KV cache groups: failed segments are reloaded by another child
    or go up by request."""
    native = {"load_range": "native"}
    return chain(
        "root",
        _hma("a", **native),
        _hma("b", **native),
        _hma("c", **native),
        _hma("d"),
        policy="stitch",
        lookup_timeout_s=t,
    )


def _chain(policy: str) -> Callable[[float], dict[str, Any]]:
    return lambda t: chain("root", _leaf("a"), _leaf("b"), policy=policy, lookup_timeout_s=t)


def _stitch(t: float) -> dict[str, Any]:
    """root = chain[stitch](a, b, c native; d sole owner): scripted children hold the
    prompt's first tokens, so each native one can load the range after the earlier ones."""
    native = {"load_range": "native"}
    return chain(
        "root",
        _leaf("a", **native),
        _leaf("b", **native),
        _leaf("c", **native),
        _leaf("d"),
        policy="stitch",
        lookup_timeout_s=t,
    )


def _stitch_nested(t: float) -> dict[str, Any]:
    """root = chain[stitch](fast native, chain[first](slow1, slow2) as one owner, disk native)"""
    slow = chain("slow", _leaf("slow1"), _leaf("slow2"), lookup_timeout_s=t)
    native = {"load_range": "native"}
    return chain(
        "root", _leaf("fast", **native), slow, _leaf("disk", **native), policy="stitch",
        lookup_timeout_s=t,
    )  # fmt: skip


def _fastest(b_prior: dict[str, float] | None) -> Callable[[float], dict[str, Any]]:
    """root = chain[fastest](a native, of a fast prior; b native, of ``b_prior`` or none;
    c native, of a slow prior; d sole owner, cold): plans of every kind (recompute, one load,
    stitches with a cut) until the timed loads and steps move the estimates. A cold child
    (d; b without a prior) takes one load at a time until a load is timed (the frozen clock
    times them at 0 s, which beats computing: one probe ends the probing), and the other
    requests plan without it meanwhile, so a load whose time never comes (a failed one, an
    abort) must stop being awaited; b cold is one that can be cut, so it is probed short."""
    native = {"load_range": "native"}
    b = {"expect_read": b_prior} if b_prior else {}

    def build(t: float) -> dict[str, Any]:
        tree = chain(
            "root",
            _leaf("a", expect_read={"latency_ms": 0.0, "gbps": 100.0}, **native),
            _leaf("b", **b, **native),
            _leaf("c", expect_read={"latency_ms": 80.0, "gbps": 0.001}, **native),
            _leaf("d"),
            policy="fastest",
            lookup_timeout_s=t,
        )
        return {**tree, "expect_prefill_tokens_per_s": 1000.0}

    return build


def _route(t: float) -> dict[str, Any]:
    return {
        "kind": "route",
        "name": "root",
        "default": "b",
        "lookup_timeout_s": t,
        "rules": [{"child": "a", "param": "tier", "equals": "a"}],
        "children": [_leaf("a"), _leaf("b")],
    }


def _fanout(t: float) -> dict[str, Any]:
    return {
        "kind": "fanout",
        "name": "root",
        "load_from": "b",
        "lookup_timeout_s": t,
        "children": [_leaf("a"), _leaf("b")],
    }


def _nested(t: float) -> dict[str, Any]:
    """root = chain[longest](route pick(fast | default → chain[first](slow1, slow2)), disk)"""
    slow = chain("slow", _leaf("slow1"), _leaf("slow2"), lookup_timeout_s=t)
    pick = {
        "kind": "route",
        "name": "pick",
        "default": "slow",
        "lookup_timeout_s": t,
        "rules": [{"child": "fast", "param": "fast"}],
        "children": [_leaf("fast"), slow],
    }
    return chain("root", pick, _leaf("disk"), policy="longest", lookup_timeout_s=t)


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("chain-first", ("a", "b"), _chain("first")),
        Shape("chain-longest", ("a", "b"), _chain("longest")),
        Shape("route", ("a", "b"), _route, ({"tier": "a"}, {"tier": "b"}, None, {"tier": None})),
        Shape("fanout", ("a", "b"), _fanout),
        Shape("nested", ("fast", "slow1", "slow2", "disk"), _nested, (None, {"fast": True})),
        Shape("chain-stitch", ("a", "b", "c", "d"), _stitch, aligned=True),
        Shape("stitch-nested", ("fast", "slow1", "slow2", "disk"), _stitch_nested, aligned=True),
        Shape(
            "chain-fastest",
            ("a", "b", "c", "d"),
            _fastest({"latency_ms": 30.0, "gbps": 1.0}),
            aligned=True,
        ),
        Shape("chain-fastest-cold", ("a", "b", "c", "d"), _fastest(None), aligned=True),
        Shape("hma-chain-first", ("a", "b"), _hma_chain, groups=2),
        Shape("hma-stitch", ("a", "b", "c", "d"), _hma_stitch, aligned=True, groups=2),
    )
}


def with_on_error_fail(tree: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """``tree`` with ``on_error: fail`` on the nodes named in ``names`` (a copy)."""
    out = dict(tree)
    if tree["name"] in names:
        out["on_error"] = "fail"
    if "children" in tree:
        out["children"] = [with_on_error_fail(c, names) for c in tree["children"]]
    return out
