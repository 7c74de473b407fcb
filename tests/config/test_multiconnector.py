"""MultiConnector JSON <-> kvcompose documents (``kvcompose convert``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose.config import ConfigError, load_config, load_tree
from kvcompose.config.multiconnector import document_notes, multiconnector_from_config
from kvcompose.config.render import simplify_document

MULTI = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {
        "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": "/kv"},
            },
        ]
    },
}


def test_multiconnector_json_loads_as_first_chain() -> None:
    config = load_config(MULTI, env={}, check_vllm=False)
    assert config.origin == "multiconnector"
    assert config.loaded_as == ("MultiConnector", None)
    assert config.tree.kind == "chain" and config.tree.policy == "first"
    assert [c.name for c in config.tree.children] == ["NixlConnector", "ExampleConnector"]
    # leaves now inherit kv_buffer_device (upstream children do not)
    assert config.tree.children[0].transfer_fields() == {
        "kv_buffer_device": "cpu",
        "kv_role": "kv_both",
    }


def test_notes_list_newly_inherited_fields() -> None:
    config = load_config(MULTI, env={}, check_vllm=False)
    notes = document_notes(MULTI, config.document)
    assert notes == [
        "connectors[0] (NixlConnector) now inherits kv_buffer_device='cpu' (vLLM's "
        "MultiConnector did not pass it down)",
        "connectors[1] (ExampleConnector) now inherits kv_buffer_device='cpu' (vLLM's "
        "MultiConnector did not pass it down)",
    ]


def test_simplified_document_drops_repeated_fields() -> None:
    doc = simplify_document(load_config(MULTI, env={}, check_vllm=False).document)
    assert doc == {
        "version": 1,
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "tree": {
            "chain": {
                "name": "chain",
                "policy": "first",
                "children": [
                    {"leaf": {"name": "NixlConnector", "connector": "NixlConnector"}},
                    {
                        "leaf": {
                            "name": "ExampleConnector",
                            "connector": "ExampleConnector",
                            "extra_config": {"shared_storage_path": "/kv"},
                        }
                    },
                ],
            }
        },
    }
    assert load_tree(doc, env={}, check_vllm=False) == load_tree(MULTI, env={}, check_vllm=False)


def test_simplify_hoists_common_fields() -> None:
    doc = simplify_document(
        load_config(MULTI["kv_connector_extra_config"], env={}, check_vllm=False).document
    )
    assert doc["kv_role"] == "kv_both"
    assert all("kv_role" not in c["leaf"] for c in doc["tree"]["chain"]["children"])


def test_round_trip_back_to_multiconnector() -> None:
    config = load_config(MULTI, env={}, check_vllm=False)
    data, notes = multiconnector_from_config(config)
    assert data == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu", "kv_role": "kv_both"},
                {
                    "kv_connector": "ExampleConnector",
                    "kv_buffer_device": "cpu",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": "/kv"},
                },
            ]
        },
    }
    assert any("on_error" in n for n in notes)
    assert load_tree(data, env={}, check_vllm=False) == config.tree


def test_engine_id_needs_compat() -> None:
    config = load_config(
        {
            "kv_role": "kv_both",
            "tree": {
                "chain": {
                    "children": [
                        {
                            "leaf": {
                                "name": "nixl",
                                "connector": "NixlConnector",
                                "engine_id": "pd-1",
                            }
                        }
                    ]
                }
            },
        },
        env={},
        check_vllm=False,
    )
    with pytest.raises(
        ConfigError,
        match="sets its own engine_id, which makes vLLM's MultiConnector raise TypeError",
    ):
        multiconnector_from_config(config)
    data, _ = multiconnector_from_config(config, compat=True)
    assert data["kv_connector_module_path"] == "kvcompose.compat"
    assert data["kv_connector_extra_config"]["connectors"][0]["engine_id"] == "pd-1"


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"chain": {"policy": "longest", "children": [{"leaf": {"connector": "A"}}]}},
            "the root is a 'longest' chain",
        ),
        ({"fanout": {"children": [{"leaf": {"connector": "A"}}]}}, "the root is a fanout"),
        (
            {"chain": {"children": [{"chain": {"children": [{"leaf": {"connector": "A"}}]}}]}},
            "chain 'chain-2' is nested",
        ),
        (
            {"chain": {"children": [{"leaf": {"connector": "A", "save": False}}]}},
            "leaf 'A' has save: false",
        ),
        (
            {"chain": {"lookup_timeout_s": 5, "children": [{"leaf": {"connector": "A"}}]}},
            "MultiConnector has no lookup timeout",
        ),
    ],
)
def test_not_flat(tree: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kv_role": "kv_both", "tree": tree}, indent=1))
    config = load_config(str(path), env={}, check_vllm=False)
    with pytest.raises(ConfigError) as info:
        multiconnector_from_config(config)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:")


def test_kv_role_required_for_multiconnector() -> None:
    config = load_config(
        {"tree": {"chain": {"children": [{"leaf": {"connector": "A"}}]}}}, env={}, check_vllm=False
    )
    with pytest.raises(ConfigError, match="kv_role: required"):
        multiconnector_from_config(config)


def test_unknown_keys_read_as_a_documents_do() -> None:
    """A MultiConnector key with no close spelling lists what is allowed, as a document's
    unknown key does (one wording: tree.messages.unknown)."""
    extra = {"connectors": [{"kv_connector": "ExampleConnector"}], "zzz": 1}
    with pytest.raises(ConfigError) as info:
        load_config(extra, env={}, check_vllm=False)
    assert str(info.value).startswith("zzz: unknown key 'zzz' (allowed: connectors, strict, hma,")
    child = {"kv_connector": "ExampleConnector", "zzz": 1}
    with pytest.raises(ConfigError) as info:
        load_config({"connectors": [child]}, env={}, check_vllm=False)
    assert str(info.value).startswith(
        "connectors[0].zzz: unknown KVTransferConfig key 'zzz' (allowed: kv_connector,"
    )
