"""``child_transfer_config``: what a leaf inherits from the composite's KVTransferConfig."""

from __future__ import annotations

import pytest
from config_helpers import needs_vllm
from pydantic import ValidationError

from kvcompose.config import child_transfer_config, load_tree
from kvcompose.tree import Leaf

PARENT = {
    "kv_connector": "KVCompose",
    "kv_connector_module_path": "kvcompose",
    "kv_connector_extra_config": {"tree": {}},
    "engine_id": "engine-0",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_port": 14579,
    "enable_permute_local_kv": False,
    "kv_load_failure_policy": "recompute",
}


def test_inherits_everything_but_the_connector_identity() -> None:
    leaf = Leaf(
        name="disk", connector="ExampleConnector", extra_config={"shared_storage_path": "/kv"}
    )
    assert child_transfer_config(PARENT, leaf) == {
        "engine_id": "engine-0",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_port": 14579,
        "enable_permute_local_kv": False,
        "kv_load_failure_policy": "recompute",
        "kv_connector": "ExampleConnector",
        "kv_connector_module_path": None,
        "kv_connector_extra_config": {"shared_storage_path": "/kv"},
    }


def test_leaf_fields_override() -> None:
    leaf = Leaf(
        name="nixl",
        connector="NixlConnector",
        module_path="my.nixl",
        kv_role="kv_consumer",
        engine_id="pd-7",
        transfer_config={"new_field": 3},
    )
    out = child_transfer_config(PARENT, leaf)
    assert out["kv_role"] == "kv_consumer"
    assert out["engine_id"] == "pd-7"
    assert out["new_field"] == 3
    assert out["kv_connector_module_path"] == "my.nixl"
    assert out["kv_buffer_device"] == "cpu"


def test_unset_parent_fields_are_not_inherited() -> None:
    leaf = Leaf(name="a", connector="ExampleConnector")
    out = child_transfer_config({"kv_role": "kv_both", "engine_id": None}, leaf)
    assert "engine_id" not in out


def test_leaf_cannot_smuggle_identity_fields() -> None:
    with pytest.raises(ValidationError, match="use the leaf's 'connector'"):
        Leaf(name="a", connector="ExampleConnector", transfer_config={"kv_connector": "Other"})


def test_extra_config_is_a_copy() -> None:
    extra = {"x": 1}
    out = child_transfer_config(PARENT, Leaf(name="a", connector="A", extra_config=extra))
    out["kv_connector_extra_config"]["x"] = 2
    assert extra == {"x": 1}


def test_rejects_other_types() -> None:
    with pytest.raises(TypeError):
        child_transfer_config(42, Leaf(name="a", connector="A"))  # type: ignore[arg-type]


@needs_vllm
def test_builds_kv_transfer_configs_vllm_accepts() -> None:
    import dataclasses

    from vllm.config import KVTransferConfig

    parent = KVTransferConfig(
        kv_connector="KVCompose",
        kv_connector_module_path="kvcompose",
        kv_role="kv_producer",
        kv_buffer_device="cpu",
        kv_load_failure_policy="recompute",
        engine_id="e0",
        kv_connector_extra_config={"tree": {}},
    )
    tree = load_tree(
        {
            "tree": {
                "chain": {
                    "children": [
                        {
                            "leaf": {
                                "name": "a",
                                "connector": "ExampleConnector",
                                "extra_config": {"shared_storage_path": "/kv"},
                            }
                        },
                        {
                            "leaf": {
                                "name": "b",
                                "connector": "NixlConnector",
                                "engine_id": "pd-1",
                                "kv_role": "kv_both",
                            }
                        },
                    ]
                }
            }
        },
        env={},
        check_vllm=False,
    )
    as_dict = {f.name: getattr(parent, f.name) for f in dataclasses.fields(parent)}
    for child in tree.children:
        for source in (as_dict, parent):  # a plain dict, or the dataclass itself
            ktc = KVTransferConfig(**child_transfer_config(source, child))
            assert ktc.kv_connector == child.connector
            assert ktc.kv_buffer_device == "cpu"  # upstream MultiConnector would drop these
            assert ktc.kv_load_failure_policy == "recompute"
            assert ktc.kv_connector_module_path is None
    a, b = (KVTransferConfig(**child_transfer_config(as_dict, c)) for c in tree.children)
    assert (a.kv_role, a.engine_id) == ("kv_producer", "e0")
    assert (b.kv_role, b.engine_id) == ("kv_both", "pd-1")  # vLLM MultiConnector W13: TypeError
    assert a.kv_connector_extra_config == {"shared_storage_path": "/kv"}
