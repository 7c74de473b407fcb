"""``tree_from_extra_config``: every form the KVCompose connector accepts, and overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompose import tree as nodes
from kvcompose.config import (
    ConfigError,
    config_from_extra_config,
    load_config,
    tree_from_extra_config,
)

DOC = """\
version: 1
kv_role: kv_both
tree:
  chain:
    name: tiers
    policy: longest
    children:
      - leaf: {name: ram, connector: ExampleConnector, extra_config: {shared_storage_path: /ram}}
      - leaf: {name: disk, connector: ExampleConnector, extra_config: {shared_storage_path: /disk}}
"""


@pytest.fixture
def tree_file(tmp_path: Path) -> str:
    path = tmp_path / "tiers.yaml"
    path.write_text(DOC)
    return str(path)


def leaf(tree: nodes.Node, name: str) -> nodes.Leaf:
    found = [n for _, n in nodes.walk(tree) if n.name == name]
    assert found and isinstance(found[0], nodes.Leaf)
    return found[0]


def test_internal_tree_key_form() -> None:
    tree = nodes.Chain(name="c", children=(nodes.Leaf(name="a", connector="X"),))
    got = tree_from_extra_config(
        {nodes.TREE_KEY: nodes.dump_node(tree), "strict": True},
        env={"KVCOMPOSE_SET": "a.save=false"},
    )
    assert got == tree  # pre-validated: no checks, no overrides


def test_internal_tree_key_form_broken() -> None:
    with pytest.raises(ConfigError, match="malformed internal tree"):
        tree_from_extra_config({nodes.TREE_KEY: {"kind": "chain"}})


def test_config_path_form(tree_file: str) -> None:
    assert (
        tree_from_extra_config({"config": tree_file}, env={}, check_vllm=False)
        == load_config(tree_file, env={}, check_vllm=False).tree
    )


def test_inline_document_form(tree_file: str) -> None:
    import yaml

    doc = yaml.safe_load(Path(tree_file).read_text())
    assert (
        tree_from_extra_config({**doc, "strict": False}, env={}, check_vllm=False)
        == load_config(tree_file, env={}, check_vllm=False).tree
    )


def test_multiconnector_form() -> None:
    tree = tree_from_extra_config(
        {
            "connectors": [
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": "/a"},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "engine_id": "e2",
                    "kv_buffer_device": "cpu",
                },
                {
                    "kv_connector": "MyConnector",
                    "kv_connector_module_path": "my.mod",
                    "kv_role": "kv_consumer",
                    "kv_port": 5000,
                },
            ]
        },
        env={},
        check_vllm=False,
    )
    assert tree == nodes.Chain(
        name="chain",
        policy="first",
        children=(
            nodes.Leaf(
                name="ExampleConnector",
                connector="ExampleConnector",
                extra_config={"shared_storage_path": "/a"},
                kv_role="kv_both",
            ),
            nodes.Leaf(
                name="ExampleConnector-2",
                connector="ExampleConnector",
                kv_role="kv_both",
                engine_id="e2",
                kv_buffer_device="cpu",
            ),
            nodes.Leaf(
                name="MyConnector",
                connector="MyConnector",
                module_path="my.mod",
                kv_role="kv_consumer",
                kv_port=5000,
            ),
        ),
    )


def test_multiconnector_form_nested() -> None:
    tree = tree_from_extra_config(
        {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": "MultiConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
                    },
                },
            ]
        },
        env={},
        check_vllm=False,
    )
    assert isinstance(tree, nodes.Chain)
    nested = tree.children[1]
    assert isinstance(nested, nodes.Chain) and nested.name == "chain-2"
    assert nested.children[0].name == "ExampleConnector"


def test_multiconnector_nested_error_path() -> None:
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config(
            {
                "connectors": [
                    {
                        "kv_connector": "MultiConnector",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {
                            "connectors": [{"kv_connector": "ExampleConnector", "kv_role": "both"}]
                        },
                    }
                ]
            },
            env={},
            check_vllm=False,
        )
    assert str(info.value).startswith(
        "kv_connector_extra_config: connectors[0].kv_connector_extra_config.connectors[0]"
        ".kv_role: must be one of"
    )


def test_env_config_file(tree_file: str) -> None:
    tree = tree_from_extra_config(
        {"kv_role": "kv_consumer"}, env={"KVCOMPOSE_CONFIG_FILE": tree_file}, check_vllm=False
    )
    assert leaf(tree, "ram").transfer_fields()["kv_role"] == "kv_consumer"


def test_nothing_given() -> None:
    with pytest.raises(ConfigError, match="no tree given: expected 'tree'"):
        tree_from_extra_config({"strict": True}, env={})
    with pytest.raises(ConfigError, match="expected a mapping"):
        tree_from_extra_config(["tree"], env={})  # type: ignore[arg-type]


def test_config_path_must_be_a_string(tree_file: str) -> None:
    with pytest.raises(
        ConfigError,
        match=r"kv_connector_extra_config: config: expected a "
        r"file path, got an integer",
    ):
        tree_from_extra_config({"config": 3}, env={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope.yaml: no such file"):
        tree_from_extra_config({"config": str(tmp_path / "nope.yaml")}, env={})


def test_config_may_be_a_path_object(tree_file: str) -> None:
    """Made text before the walk, which refuses what is not JSON."""
    tree = tree_from_extra_config({"config": Path(tree_file)}, env={}, check_vllm=False)
    assert tree.policy == "longest"


# --------------------------------------------------------------------------- precedence


def test_precedence_defaults_file_env_extra(tree_file: str) -> None:
    # default policy is "first"; the file says "longest"
    assert (
        tree_from_extra_config({"config": tree_file}, env={}, check_vllm=False).policy == "longest"
    )
    env = {
        "KVCOMPOSE_SET": "tiers.policy=first; ram.extra_config.shared_storage_path=/env; "
        "kv_role=kv_producer",
    }
    tree = tree_from_extra_config({"config": tree_file}, env=env, check_vllm=False)
    assert tree.policy == "first"  # environment beats the file
    assert leaf(tree, "ram").extra_config == {"shared_storage_path": "/env"}
    assert leaf(tree, "ram").transfer_fields()["kv_role"] == "kv_producer"
    tree = tree_from_extra_config(
        {
            "config": tree_file,
            "kv_role": "kv_consumer",
            "set": {"tiers.policy": "longest", "disk.save": False},
        },
        env=env,
        check_vllm=False,
    )
    assert tree.policy == "longest"  # extra-config keys beat the environment
    assert leaf(tree, "ram").transfer_fields()["kv_role"] == "kv_consumer"
    assert leaf(tree, "disk").save is False
    assert leaf(tree, "ram").extra_config == {"shared_storage_path": "/env"}


def test_env_beats_an_inline_document() -> None:
    extra = {"kv_role": "kv_both", "tree": {"leaf": {"name": "a", "connector": "X"}}}
    tree = tree_from_extra_config(
        extra,
        env={"KVCOMPOSE_SET": "kv_role=kv_consumer; a.save=false"},
        check_vllm=False,
    )
    assert tree.transfer_fields() == {"kv_role": "kv_consumer"} and tree.save is False
    tree = tree_from_extra_config(
        {**extra, "set": {"a.save": True}}, env={"KVCOMPOSE_SET": "a.save=false"}, check_vllm=False
    )
    assert tree.save is True


def test_env_typed_values() -> None:
    config = config_from_extra_config(
        {"tree": {"leaf": {"name": "a", "connector": "X"}}},
        env={
            "KVCOMPOSE_SET": "kv_port=5600; engine_id='0123'; enable_permute_local_kv=true; "
            "hma=false; a.extra_config.sizes=[1, 2]; a.extra_config.name='007'",
        },
        check_vllm=False,
    )
    assert config.transfer == {
        "kv_port": 5600,
        "engine_id": "0123",
        "enable_permute_local_kv": True,
    }
    assert config.hma is False
    assert config.tree.extra_config == {"sizes": [1, 2], "name": "007"}
    assert config.overrides == (
        "KVCOMPOSE_SET 'kv_port=5600'",
        "KVCOMPOSE_SET \"engine_id='0123'\"",
        "KVCOMPOSE_SET 'enable_permute_local_kv=true'",
        "KVCOMPOSE_SET 'hma=false'",
        "KVCOMPOSE_SET 'a.extra_config.sizes=[1, 2]'",
        "KVCOMPOSE_SET \"a.extra_config.name='007'\"",
    )


def test_empty_env_vars_are_unset(tree_file: str) -> None:
    config = config_from_extra_config(
        {"config": tree_file}, check_vllm=False, env={"KVCOMPOSE_SET": " "}
    )
    assert config.overrides == ()
    assert config.transfer == {"kv_role": "kv_both"}


def test_os_environ_is_the_default(tree_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOMPOSE_SET", "disk.save=false")
    assert (
        leaf(tree_from_extra_config({"config": tree_file}, check_vllm=False), "disk").save is False
    )
    assert leaf(load_config(tree_file, check_vllm=False).tree, "disk").save is False
    assert leaf(load_config(tree_file, env={}, check_vllm=False).tree, "disk").save is True


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVCOMPOSE_SET": "disk"}, "KVCOMPOSE_SET: 'disk' is not of the form 'node.key=value'"),
        (
            {"KVCOMPOSE_SET": "tiers.name=x"},
            "KVCOMPOSE_SET 'tiers.name=x': 'name' cannot be overridden",
        ),
        (
            {"KVCOMPOSE_SET": "ram.connector.x=1"},
            "KVCOMPOSE_SET 'ram.connector.x=1': 'connector' of node 'ram' is not a mapping",
        ),
        ({"KVCOMPOSE_SET": "hma=maybe"}, "KVCOMPOSE_SET 'hma=maybe': hma: must be true, false"),
        (
            {"KVCOMPOSE_SET": "kv_port=http"},
            "KVCOMPOSE_SET 'kv_port=http': kv_port: expected an integer",
        ),
        # several overrides: the first at fault is named, whatever follows it
        (
            {"KVCOMPOSE_SET": "kv_port=http; disk.save=false"},
            "KVCOMPOSE_SET 'kv_port=http': kv_port: expected an integer",
        ),
        (
            {"KVCOMPOSE_SET": "disk.save=false; kv_port=http"},
            "KVCOMPOSE_SET 'kv_port=http': kv_port: expected an integer",
        ),
        (
            {"KVCOMPOSE_SET": "kv_port=http; nowhere.save=false"},
            "KVCOMPOSE_SET 'kv_port=http': kv_port: expected an integer",
        ),
        # values are read as files are: a repeated key is refused, a date is worded
        (
            {"KVCOMPOSE_SET": "ram.extra_config.x={a: 1, a: 2}"},
            "KVCOMPOSE_SET 'ram.extra_config.x={a: 1, a: 2}':1: a: duplicate key 'a'",
        ),
        (
            {"KVCOMPOSE_SET": "ram.extra_config.x=2024-01-31"},
            "KVCOMPOSE_SET 'ram.extra_config.x=2024-01-31': YAML reads the unquoted 2024-01-31 "
            "as a date, which is not a JSON value",
        ),
        # the per-field variables of older releases are refused, never silently ignored
        (
            {"KVCOMPOSE_KV_ROLE": "kv_producer"},
            "KVCOMPOSE_KV_ROLE is no longer read: set top-level fields with KVCOMPOSE_SET, "
            "e.g. KVCOMPOSE_SET='kv_role=kv_producer'",
        ),
    ],
)
def test_bad_env(tree_file: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config({"config": tree_file}, env=env, check_vllm=False)
    assert str(info.value).startswith(message)


def test_bad_extra_override(tree_file: str) -> None:
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config({"config": tree_file, "tree": {}}, env={})
    assert str(info.value) == ("kv_connector_extra_config.tree: 'tree' cannot be overridden")
    with pytest.raises(ConfigError) as info:
        tree_from_extra_config({"config": tree_file, "set": ["a"]}, env={})
    assert "expected a mapping of 'node.key' to values" in str(info.value)
