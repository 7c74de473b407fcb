"""Checks and facts that need vLLM, the composite's class choice, and the vLLM plugin."""

from __future__ import annotations

import tomllib

import pytest
from config_helpers import ROOT, needs_vllm

from kvcompose.config import ConfigError, load_config
from kvcompose.config.render import composite_class


def tree(*leaves: dict, hma: object = "auto") -> dict:
    return {
        "kv_role": "kv_both",
        "hma": hma,
        "tree": {"chain": {"children": [{"leaf": leaf} for leaf in leaves]}},
    }


@needs_vllm
def test_facts_hma_layout_piecewise() -> None:
    config = load_config(
        tree(
            {"name": "nixl", "connector": "NixlConnector"},
            {
                "name": "lmc",
                "connector": "LMCacheConnectorV1",
                "extra_config": {"use_layerwise": True},
            },
            {"name": "hs", "connector": "ExampleHiddenStatesConnector"},
        ),
        env={},
        check_vllm=True,
    )
    facts = config.facts
    assert facts is not None
    assert facts.leaves["nixl"].class_name == "NixlPullConnector"
    assert facts.leaves["nixl"].supports_hma is True
    assert facts.leaves["lmc"].supports_hma is False
    assert facts.piecewise == ["lmc"]
    assert facts.layouts == {"LBHNC": ["nixl"], "LBNHC": ["hs"]}
    assert any("different KV cache layouts" in w for w in config.warnings)
    assert "KVCompose" in facts.registry and "NixlConnector" in facts.registry
    assert composite_class(config) == "KVCompose"


@needs_vllm
def test_class_choice_follows_hma() -> None:
    hma_leaves = (
        {"name": "nixl", "connector": "NixlConnector"},
        {"name": "off", "connector": "OffloadingConnector"},
    )
    assert (
        composite_class(load_config(tree(*hma_leaves), env={}, check_vllm=True)) == "KVComposeHMA"
    )
    assert (
        composite_class(load_config(tree(*hma_leaves, hma=False), env={}, check_vllm=True))
        == "KVCompose"
    )
    assert (
        composite_class(load_config(tree(*hma_leaves, hma=True), env={}, check_vllm=True))
        == "KVComposeHMA"
    )
    # without the vLLM check, auto cannot know: the safe class
    assert composite_class(load_config(tree(*hma_leaves), env={}, check_vllm=False)) == "KVCompose"
    assert (
        composite_class(load_config(tree(*hma_leaves, hma=True), env={}, check_vllm=False))
        == "KVComposeHMA"
    )


@needs_vllm
def test_checks_run_for_the_extra_config_forms() -> None:
    from kvcompose.config import tree_from_extra_config

    with pytest.raises(ConfigError) as info:
        tree_from_extra_config(
            {
                "connectors": [
                    {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
                    {"kv_connector": "NixlConector", "kv_role": "kv_both"},
                ]
            },
            env={},
        )
    assert str(info.value).startswith(
        "kv_connector_extra_config: connectors[1].kv_connector: unknown connector "
        "'NixlConector' (did you mean 'NixlConnector'?); known: "
    )


@needs_vllm
def test_vllm_rejects_child_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    def reject(self: object) -> None:
        raise ValueError("kv_buffer_device 'tpu' is not supported\nmore detail")

    monkeypatch.setattr(KVTransferConfig, "__post_init__", reject)
    with pytest.raises(ConfigError) as info:
        load_config(
            tree({"connector": "ExampleConnector", "kv_buffer_device": "tpu"}),
            env={},
            check_vllm=True,
        )
    assert str(info.value) == (
        "tree.chain.children[0].leaf: vLLM rejects this child's KVTransferConfig: "
        "kv_buffer_device 'tpu' is not supported"
    )


def test_offline_skips_vllm_checks() -> None:
    config = load_config(tree({"connector": "NoSuchConnector"}), env={}, check_vllm=False)
    assert config.facts is None


# --------------------------------------------------------------------------- plugin


def test_plugin_entry_point_is_declared() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = data["project"]["entry-points"]["vllm.general_plugins"]["kvcompose"]
    module, _, attr = target.partition(":")
    import importlib

    assert callable(getattr(importlib.import_module(module), attr))


@needs_vllm
def test_register_is_idempotent_and_lazy(caplog: pytest.LogCaptureFixture) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.plugin import register

    register()
    register()  # vLLM may call general plugins more than once
    registry = KVConnectorFactory._registry
    assert {"KVCompose", "KVComposeHMA"} <= set(registry)
    assert not [r for r in caplog.records if "already registered" in r.getMessage()]
    cls = KVConnectorFactory.get_connector_class_by_name("KVCompose")
    assert cls.__name__ == "KVCompose"
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector="KVComposeHMA", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc).__name__ == "KVComposeHMA"


@needs_vllm
def test_register_leaves_foreign_names_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.plugin import register

    def foreign() -> type:
        raise AssertionError("not loaded")

    registry = dict(KVConnectorFactory._registry)
    registry.pop("KVComposeHMA", None)
    registry["KVCompose"] = foreign
    monkeypatch.setattr(KVConnectorFactory, "_registry", registry)
    register()
    assert KVConnectorFactory._registry["KVCompose"] is foreign
    assert "KVComposeHMA" in KVConnectorFactory._registry
    assert any("already registered by another package" in r.getMessage() for r in caplog.records)


def test_register_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvcompose.plugin import register

    monkeypatch.setitem(sys.modules, "vllm.distributed.kv_transfer.kv_connector.factory", None)
    register()  # no error


@needs_vllm
def test_layout_facts_and_conflict_warning() -> None:
    config = load_config(
        tree(
            {"name": "nixl", "connector": "NixlConnector"},
            {"name": "hisparse", "connector": "HiSparseConnector"},
            {"name": "disk", "connector": "ExampleConnector"},
        ),
        env={},
        check_vllm=True,
    )
    leaves = config.facts.leaves
    assert (leaves["nixl"].layout, leaves["nixl"].layout_scope) == ("LBHNC", "non-MLA models")
    assert (leaves["hisparse"].layout, leaves["hisparse"].layout_scope) == ("BLHNC", "")
    assert leaves["disk"].layout is None
    assert config.warnings == (
        "leaves require different KV cache layouts: LBHNC (nixl); BLHNC (hisparse); the "
        "composite refuses to start where these apply",
    )
