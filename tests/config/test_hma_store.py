"""HMA with kvcompose's own store: ``hma: auto`` picks HMA when every child supports it (the
store included), ``hma: true`` accepts the store, ``explain`` names a child that forces HMA
off with what it costs, and ``kvcompose.compat`` gets vLLM's MultiConnector rule."""

from __future__ import annotations

from typing import Any

from config_helpers import needs_vllm

from kvcompose.cli.explain_cmd import vllm_view
from kvcompose.config import load_config
from kvcompose.config.render import composite_class

STORE = {
    "name": "disk",
    "connector": "PrefixStoreConnector",
    "module_path": "kvcompose.stores",
    "extra_config": {"path": "/tmp/kv"},
}
NIXL = {"name": "nixl", "connector": "NixlConnector"}
EXAMPLE = {"name": "ram", "connector": "ExampleConnector"}


def _tree(*leaves: dict[str, Any], hma: object = "auto") -> dict[str, Any]:
    children = [{"leaf": leaf} for leaf in leaves]
    return {
        "kv_role": "kv_both",
        "hma": hma,
        "tree": {"chain": {"name": "tiers", "policy": "longest", "children": children}},
    }


@needs_vllm
def test_auto_picks_hma_with_the_store() -> None:
    config = load_config(_tree(STORE, NIXL), env={}, check_vllm=True)
    assert config.facts is not None and config.facts.leaves["disk"].supports_hma is True
    assert composite_class(config) == "KVComposeHMA"
    view = vllm_view(config)
    assert "HMA: on: every leaf supports the hybrid KV cache manager" in view
    (stores,) = [line for line in view if line.startswith("HMA and the stores")]
    assert stores.startswith("HMA and the stores (disk): each KV cache group saved")
    # hma: true with the store is accepted (it was refused while the store lacked HMA).
    required = load_config(_tree(STORE, hma=True), env={}, check_vllm=True)
    assert composite_class(required) == "KVComposeHMA"


@needs_vllm
def test_a_child_without_hma_is_named_with_its_cost() -> None:
    config = load_config(_tree(STORE, EXAMPLE), env={}, check_vllm=True)
    assert composite_class(config) == "KVCompose"
    (line,) = [x for x in vllm_view(config) if x.startswith("HMA:")]
    assert line.startswith("HMA: off: not supported by ram; vLLM turns the hybrid KV cache")
    assert "the same KV memory holds fewer blocks" in line


@needs_vllm
def test_compat_follows_multiconnector_rule() -> None:
    """vLLM decides HMA for ``kvcompose.compat`` by name, as for its own MultiConnector: on
    when all children support it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    def compat(*children: dict[str, Any]) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_connector_module_path="kvcompose.compat",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": list(children)},
        )

    store = {
        "kv_connector": "PrefixStoreConnector",
        "kv_connector_module_path": "kvcompose.stores",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": "/tmp/kv"},
    }
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    assert KVConnectorFactory.supports_hma_config(compat(store, nixl)) is True
    assert KVConnectorFactory.supports_hma_config(compat(store, example)) is False
