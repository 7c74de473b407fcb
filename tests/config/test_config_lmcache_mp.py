"""What ``validate`` and ``explain`` know about LMCache's multi-process connector
(``LMCacheMPConnector``; ``kvcompose.config.known``, ``kvcompose.tree.ranges``), offline."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from config_helpers import needs_vllm

from kvcompose.cli.explain_cmd import explain
from kvcompose.config import ConfigError, load_config
from kvcompose.tree.ranges import known_range_support

SERVER = {
    "lmcache.mp.host": "tcp://127.0.0.1",
    "lmcache.mp.port": 15555,
    "lmcache.mp.mp_transfer_mode": "lmcache_driven",
}
LMCACHE_MP = {"name": "lmc", "connector": "LMCacheMPConnector", "extra_config": SERVER}
STORE = {
    "name": "store",
    "connector": "PrefixStoreConnector",
    "module_path": "kvcompose.stores",
    "extra_config": {"path": "/tmp/kvcompose-test-store"},
}
NIXL = {"name": "nixl", "connector": "NixlConnector"}


def tree(*leaves: dict[str, Any], hma: object = "auto", policy: str = "first") -> dict:
    children = [{"leaf": leaf} for leaf in leaves]
    return {
        "kv_role": "kv_both",
        "hma": hma,
        "tree": {"chain": {"name": "tiers", "policy": policy, "children": children}},
    }


def text(items: list[Any]) -> str:
    from rich.console import Console

    console = Console(width=400, record=True)
    for item in items:
        console.print(item)
    return console.export_text()


def test_offline_explain_knows_hma_async_loads_stitch_mode_and_extra_config() -> None:
    config = load_config(tree(STORE, LMCACHE_MP, policy="stitch"), env={}, check_vllm=False)
    assert config.facts is None
    out = text(explain(config))
    assert "LMCache MP: HMA yes, no layout requirement (known without vLLM)" in out
    assert "loads asynchronously from its lmcache server" in out
    assert "delays a request's free until its save is done" in out
    assert "in a stitch native from any block boundary" in out and "cannot be cut" in out
    assert "lmcache.mp.mp_transfer_mode: lmcache_driven" in out
    assert "needs the 'lmcache' package where vLLM runs" in out
    assert "vendored adapter" not in out  # vLLM's own module imports lmcache too
    assert not config.warnings


def test_hma_true_is_accepted() -> None:
    load_config(tree(LMCACHE_MP, hma=True), env={}, check_vllm=False)


def test_stitch_mode_is_native_from_a_block_and_uncut() -> None:
    support = known_range_support("LMCacheMPConnector")
    assert (support.mode, support.align, support.can_cut) == ("native", None, False)


@pytest.mark.parametrize(
    ("extra", "warned"),
    [
        (SERVER, False),
        ({"lmcache.mp.server_urls": "tcp://10.0.0.1:6667"}, False),
        ({"lmcache.mp.host": "tcp://127.0.0.1"}, True),
        ({}, True),
    ],
)
def test_a_leaf_without_a_server_address_is_warned(extra: dict[str, Any], warned: bool) -> None:
    leaf = {**LMCACHE_MP, "extra_config": extra}
    config = load_config(tree(leaf), env={}, check_vllm=False)
    hits = [w for w in config.warnings if "it dials tcp://localhost:5555" in w]
    assert bool(hits) is warned


def test_ahead_of_nixl_in_a_first_chain_is_warned_as_lmcache_v1_is() -> None:
    config = load_config(tree(LMCACHE_MP, NIXL), env={}, check_vllm=False)
    assert [w for w in config.warnings if "short LMCache hit wins over the remote prefill" in w]
    config = load_config(tree(NIXL, LMCACHE_MP), env={}, check_vllm=False)
    assert not config.warnings


@needs_vllm
def test_checked_against_vllm() -> None:
    """Without lmcache, vLLM's module for the class cannot be imported (it imports lmcache at
    the top): an error naming the connector. With it, vLLM resolves the name to LMCache's own
    class, which has HMA."""
    if importlib.util.find_spec("lmcache") is None:
        with pytest.raises(ConfigError, match="'LMCacheMPConnector' cannot be imported"):
            load_config(tree(NIXL, LMCACHE_MP), env={}, check_vllm=True)
        return
    config = load_config(tree(NIXL, LMCACHE_MP), env={}, check_vllm=True)
    assert config.facts is not None
    assert config.facts.leaves["lmc"].supports_hma is True
    assert not [w for w in config.warnings if "'lmcache' package" in w]
