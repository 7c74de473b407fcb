"""What ``validate`` and ``explain`` know about LMCache (``kvcompose.config.known``)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from config_helpers import needs_vllm

from kvcompose.cli.explain_cmd import explain, vllm_view
from kvcompose.config import ConfigError, load_config


def tree(*leaves: dict[str, Any], hma: object = "auto", policy: str = "first") -> dict:
    children = [{"leaf": leaf} for leaf in leaves]
    return {
        "kv_role": "kv_both",
        "hma": hma,
        "tree": {"chain": {"name": "decode", "policy": policy, "children": children}},
    }


LMCACHE = {"name": "lmc", "connector": "LMCacheConnectorV1"}
NIXL = {"name": "nixl", "connector": "NixlConnector"}


def text(items: list[Any]) -> str:
    from rich.console import Console

    console = Console(width=400, record=True)
    for item in items:
        console.print(item)
    return console.export_text()


def test_hma_true_with_lmcache_fails_without_vllm() -> None:
    with pytest.raises(ConfigError, match="'LMCacheConnectorV1' does not support HMA"):
        load_config(tree(LMCACHE, hma=True), env={}, check_vllm=False)


def test_offline_explain_knows_lmcache_hma_layout_and_loads() -> None:
    config = load_config(tree(NIXL, LMCACHE), env={}, check_vllm=False)
    assert config.facts is None
    out = text(explain(config))
    assert "LMCache: HMA no, no layout requirement (known without vLLM)" in out
    assert "loads synchronously in the step" in out and "never delays a free" in out
    assert "needs the 'lmcache' package" in out
    assert any(line.startswith("HMA: off: not supported by lmc;") for line in vllm_view(config))


def test_vendored_adapter_needs_no_package() -> None:
    native = {**LMCACHE, "extra_config": {"use_native": True}}
    out = text(explain(load_config(tree(native), env={}, check_vllm=False)))
    assert "needs the 'lmcache' package" not in out


@pytest.mark.parametrize(
    ("order", "policy", "warned"),
    [
        ((LMCACHE, NIXL), "first", True),
        ((NIXL, LMCACHE), "first", False),
        ((LMCACHE, NIXL), "longest", False),
    ],
)
def test_lmcache_ahead_of_nixl_in_a_first_chain_is_warned(
    order: tuple[dict[str, Any], ...], policy: str, warned: bool
) -> None:
    config = load_config(tree(*order, policy=policy), env={}, check_vllm=False)
    hits = [w for w in config.warnings if "short LMCache hit wins over the remote prefill" in w]
    assert bool(hits) is warned


@needs_vllm
def test_checked_against_vllm_a_missing_lmcache_package_is_warned() -> None:
    config = load_config(tree(NIXL, LMCACHE), env={}, check_vllm=True)
    assert config.facts is not None
    assert config.facts.leaves["lmc"].supports_hma is False
    assert config.facts.leaves["lmc"].layout is None
    missing = importlib.util.find_spec("lmcache") is None
    warned = [w for w in config.warnings if "needs the 'lmcache' package" in w]
    assert bool(warned) is missing
    native = {**LMCACHE, "extra_config": {"use_native": True}}
    config = load_config(tree(NIXL, native), env={}, check_vllm=True)
    assert not [w for w in config.warnings if "'lmcache' package" in w]
