"""Every file in examples/ (top level) validates, explains, and prints vLLM arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_helpers import EXAMPLES, vllm_importable

from kvcompose.config import load_config, tree_from_extra_config
from kvcompose.tree import leaves, walk

FILES = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def test_the_issue_examples_exist() -> None:
    names = {p.name for p in FILES}
    assert {
        "pd-disk-tier.yaml",
        "two-disk-tiers.yaml",
        "route-by-params.yaml",
        "multiconnector-dropin.json",
        "fastest-tiers.yaml",
        "shared-tier-mooncake.yaml",
        "pd-offload-decode.yaml",
    } <= names


def test_the_feature_examples_show_their_feature() -> None:
    """``policy: fastest`` with priors, a shared Mooncake tier behind a local one, and a decode
    engine with an offload tier in front of NIXL."""
    fastest = load_config(str(EXAMPLES / "fastest-tiers.yaml"), env={}, check_vllm=False).tree
    assert fastest.kind == "chain" and fastest.policy == "fastest"
    assert fastest.expect_prefill_tokens_per_s
    assert all(leaf.expect_read is not None for leaf in leaves(fastest))

    shared = load_config(str(EXAMPLES / "shared-tier-mooncake.yaml"), env={}, check_vllm=False)
    assert [leaf.connector for leaf in leaves(shared.tree)] == [
        "PrefixStoreConnector",
        "MooncakeStoreConnector",
    ]
    per_engine = load_config(
        str(EXAMPLES / "shared-tier-mooncake.yaml"),
        env={"KVCOMPOSE_SET": "shared.extra_config.lookup_rpc_port=2"},
        check_vllm=False,
    )
    assert leaves(per_engine.tree)[1].extra_config["lookup_rpc_port"] == 2

    decode = load_config(str(EXAMPLES / "pd-offload-decode.yaml"), env={}, check_vllm=False)
    assert decode.transfer["kv_role"] == "kv_consumer"
    offload, nixl = leaves(decode.tree)
    assert (offload.connector, offload.kv_role) == ("OffloadingConnector", "kv_both")
    assert nixl.connector == "NixlConnector"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_validates(path: Path, run_cli) -> None:
    config = load_config(str(path), env={}, check_vllm=vllm_importable())
    assert not config.warnings
    code, out, err = run_cli("validate", "--no-env", str(path))
    assert code == 0, err
    assert out.startswith(f"{path}: ok (")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_explains(path: Path, run_cli) -> None:
    config = load_config(str(path), env={}, check_vllm=False)
    code, out, err = run_cli("explain", "--no-env", str(path))
    assert code == 0, err
    for _, node in walk(config.tree):
        assert f"{node.name}  " in out
    assert "What vLLM sees" in out
    assert "kv_connector: " in out
    if vllm_importable():
        assert "HMA: " in out and "KV cache layout" in out and "CUDA graphs" in out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_vllm_args(path: Path, run_cli) -> None:
    code, out, err = run_cli("vllm-args", "--no-env", "--json", str(path))
    assert code == 0, err
    data = json.loads(out)
    assert data["kv_connector"] in ("KVCompose", "KVComposeHMA")
    tree = tree_from_extra_config(data["kv_connector_extra_config"], env={})
    original = load_config(str(path), env={}, check_vllm=False).tree
    assert [leaf.name for leaf in leaves(tree)] == [leaf.name for leaf in leaves(original)]
    if vllm_importable():
        from vllm.config import KVTransferConfig

        KVTransferConfig(**data)  # vLLM accepts the top-level config as printed


def test_dropin_is_the_compat_multiconnector() -> None:
    data = json.loads((EXAMPLES / "multiconnector-dropin.json").read_text())
    assert data["kv_connector"] == "MultiConnector"
    assert data["kv_connector_module_path"] == "kvcompose.compat"
    config = load_config(data, env={}, check_vllm=False)
    assert config.tree.kind == "chain" and config.tree.policy == "first"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("by_path", [False, True], ids=["inline", "by-path"])
def test_vllm_resolves_the_printed_config(path: Path, by_path: bool) -> None:
    """What vllm-args prints is what vLLM's factory and the composite's class-level hooks
    accept (no engine is started)."""
    if not vllm_importable():
        pytest.skip("needs vLLM")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.config.render import vllm_args

    data = vllm_args(load_config(str(path), env={}), by_path=by_path)
    ktc = KVTransferConfig(**data)
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls.__name__ == data["kv_connector"]
    assert cls.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is False
    assert KVConnectorFactory.supports_hma_config(ktc) is (data["kv_connector"] == "KVComposeHMA")
