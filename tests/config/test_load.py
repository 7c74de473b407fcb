"""Loading valid configs: the spec they become, names, inheritance, input forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompose import tree as nodes
from kvcompose.config import ConfigError, effective_saves, load_config, load_tree
from kvcompose.config.document_form import document_from_tree

TIERS = """\
version: 1
kv_role: kv_both
kv_buffer_device: cpu
tree:
  chain:
    name: tiers
    policy: longest
    lookup_timeout_s: 5
    children:
      - leaf:
          {name: ram, connector: ExampleConnector, extra_config: {shared_storage_path: /dev/shm/kv}}
      - leaf:
          name: disk
          connector: ExampleConnector
          kv_buffer_device: cuda
          extra_config: {shared_storage_path: /var/kv}
          save: false
          on_error: fail
"""


def write(tmp_path: Path, text: str, name: str = "tree.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_file_becomes_spec(tmp_path: Path) -> None:
    tree = load_tree(write(tmp_path, TIERS), env={}, check_vllm=False)
    assert tree == nodes.Chain(
        name="tiers",
        policy="longest",
        lookup_timeout_s=5.0,
        children=(
            nodes.Leaf(
                name="ram",
                connector="ExampleConnector",
                extra_config={"shared_storage_path": "/dev/shm/kv"},
                kv_role="kv_both",
                kv_buffer_device="cpu",
            ),
            nodes.Leaf(
                name="disk",
                connector="ExampleConnector",
                extra_config={"shared_storage_path": "/var/kv"},
                kv_role="kv_both",
                kv_buffer_device="cuda",
                save=False,
                on_error="fail",
            ),
        ),
    )


def test_json_file_and_dict_give_the_same_tree(tmp_path: Path) -> None:
    data = yaml.safe_load(TIERS)
    from_yaml = load_tree(write(tmp_path, TIERS), env={}, check_vllm=False)
    from_json = load_tree(write(tmp_path, json.dumps(data), "tree.json"), env={}, check_vllm=False)
    from_dict = load_tree(data, env={}, check_vllm=False)
    assert from_yaml == from_json == from_dict


def test_path_objects(tmp_path: Path) -> None:
    path = tmp_path / "tree.yaml"
    path.write_text(TIERS)
    assert load_tree(path, env={}, check_vllm=False) == load_tree(
        str(path), env={}, check_vllm=False
    )


def test_bare_node_is_a_tree() -> None:
    tree = load_tree({"leaf": {"connector": "ExampleConnector"}}, env={}, check_vllm=False)
    assert tree == nodes.Leaf(name="ExampleConnector", connector="ExampleConnector")


def test_default_names_are_unique_and_skip_explicit_ones() -> None:
    tree = load_tree(
        {
            "tree": {
                "chain": {
                    "children": [
                        {"leaf": {"connector": "ExampleConnector"}},
                        {"leaf": {"connector": "ExampleConnector"}},
                        {"leaf": {"name": "ExampleConnector-3", "connector": "NixlConnector"}},
                        {"chain": {"children": [{"leaf": {"connector": "ExampleConnector"}}]}},
                    ]
                }
            }
        },
        env={},
        check_vllm=False,
    )
    names = [node.name for _, node in nodes.walk(tree)]
    assert names == [
        "chain",
        "ExampleConnector",
        "ExampleConnector-2",
        "ExampleConnector-3",
        "chain-2",
        "ExampleConnector-4",
    ]


def test_route_and_fanout_fields() -> None:
    tree = load_tree(
        {
            "tree": {
                "route": {
                    "name": "r",
                    "default": "cache",
                    "rules": [
                        {"param": "do_remote_prefill", "equals": None, "child": "nixl"},
                        {"param": "x", "child": "nixl"},
                        {
                            "min_prompt_tokens": 10,
                            "max_prompt_tokens": 20,
                            "predicate": "pkg.mod:fn",
                            "child": "cache",
                        },
                    ],
                    "children": [
                        {"leaf": {"name": "nixl", "connector": "NixlConnector"}},
                        {
                            "fanout": {
                                "name": "cache",
                                "load_from": "a",
                                "children": [
                                    {"leaf": {"name": "a", "connector": "ExampleConnector"}},
                                    {"leaf": {"name": "b", "connector": "ExampleConnector"}},
                                ],
                            }
                        },
                    ],
                }
            }
        },
        env={},
        check_vllm=False,
    )
    assert isinstance(tree, nodes.Route)
    assert tree.rules[0] == nodes.RouteRule(child="nixl", param="do_remote_prefill", equals=None)
    assert tree.rules[0].has_equals
    assert tree.rules[1].has_equals is False
    assert tree.rules[2] == nodes.RouteRule(
        child="cache", min_prompt_tokens=10, max_prompt_tokens=20, predicate="pkg.mod:fn"
    )
    fanout = tree.children[1]
    assert isinstance(fanout, nodes.Fanout) and fanout.load_from == "a"


def test_top_level_fields_are_inherited_and_leaf_fields_win() -> None:
    config = load_config(
        {
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "transfer_config": {"future_field": 1},
            "tree": {
                "chain": {
                    "children": [
                        {"leaf": {"name": "a", "connector": "ExampleConnector"}},
                        {
                            "leaf": {
                                "name": "b",
                                "connector": "NixlConnector",
                                "kv_role": "kv_consumer",
                                "engine_id": "pd-1",
                                "transfer_config": {"future_field": 2},
                            }
                        },
                    ]
                }
            },
        },
        env={},
        check_vllm=False,
    )
    a, b = config.tree.children
    assert a.transfer_fields() == {
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "future_field": 1,
    }
    assert b.transfer_fields() == {
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "future_field": 2,
        "engine_id": "pd-1",
    }
    assert config.transfer == {
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "future_field": 1,
    }


def test_effective_saves_follow_ancestors() -> None:
    tree = load_tree(
        {
            "tree": {
                "chain": {
                    "children": [
                        {"leaf": {"name": "a", "connector": "ExampleConnector"}},
                        {
                            "fanout": {
                                "save": False,
                                "children": [
                                    {"leaf": {"name": "b", "connector": "ExampleConnector"}}
                                ],
                            }
                        },
                        {"leaf": {"name": "c", "connector": "ExampleConnector", "save": False}},
                    ]
                }
            }
        },
        env={},
        check_vllm=False,
    )
    assert {leaf.name: s for leaf, s in effective_saves(tree)} == {
        "a": True,
        "b": False,
        "c": False,
    }


def test_warnings() -> None:
    config = load_config(
        {
            "tree": {
                "chain": {"children": [{"leaf": {"connector": "ExampleConnector", "save": False}}]}
            }
        },
        env={},
        check_vllm=False,
    )
    assert any("no leaf saves" in w for w in config.warnings)
    assert any("single child" in w for w in config.warnings)


def test_document_is_normalised_with_names(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TIERS), env={}, check_vllm=False)
    doc = config.document
    assert list(doc) == ["version", "kv_role", "kv_buffer_device", "tree"]
    children = doc["tree"]["chain"]["children"]
    assert children[0] == {
        "leaf": {
            "name": "ram",
            "connector": "ExampleConnector",
            "extra_config": {"shared_storage_path": "/dev/shm/kv"},
        }
    }
    # the normalised document loads back to the same tree
    assert load_tree(doc, env={}, check_vllm=False) == config.tree


def test_all_problems_are_kept(tmp_path: Path) -> None:
    path = write(tmp_path, "tree:\n  leaf: {connector: A, save: 1, on_error: x, kv_port: y}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, check_vllm=False)
    assert str(info.value).endswith("(and 2 more problems)")
    assert len(info.value.lines) == 3
    assert all(line.startswith(f"{path}:2: tree.leaf.") for line in info.value.lines)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ValueError):
        load_tree({"tree": {}}, env={}, check_vllm=False)


def test_not_a_path_or_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a file path or a mapping"):
        load_tree(42, env={}, check_vllm=False)  # type: ignore[arg-type]


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_tree(str(tmp_path / "nope.yaml"), env={}, check_vllm=False)
    with pytest.raises(ConfigError, match="is a directory"):
        load_tree(str(tmp_path), env={}, check_vllm=False)


def test_yaml_anchors_are_resolved(tmp_path: Path) -> None:
    text = """\
disk: &disk {connector: ExampleConnector, extra_config: {shared_storage_path: /kv}}
tree:
  chain:
    children:
      - leaf: *disk
"""
    # anchors are fine, but 'disk' is not a document key
    with pytest.raises(ConfigError, match="unknown key 'disk'"):
        load_tree(write(tmp_path, text), env={}, check_vllm=False)


# --------------------------------------------------------------------------- round trip

NAMES = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
SCALARS = st.one_of(st.integers(-5, 5), st.booleans(), st.text("abc/", max_size=5), st.none())


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> nodes.Node:
    names: set[str] = draw(st.shared(st.builds(set), key="names"))  # one set per example

    def fresh() -> str:
        name = draw(NAMES.filter(lambda n: n not in names))
        names.add(name)
        return name

    common = {"save": draw(st.booleans()), "on_error": draw(st.sampled_from(["miss", "fail"]))}
    if depth >= 2 or draw(st.booleans()):
        fields = draw(
            st.dictionaries(
                st.sampled_from(["kv_role", "engine_id"]),
                st.sampled_from(["kv_both", "kv_producer"]),
                max_size=2,
            )
        )
        future = draw(st.dictionaries(st.just("future"), st.integers(0, 3), max_size=1))
        return nodes.Leaf(
            name=fresh(),
            connector=draw(st.sampled_from(["ExampleConnector", "OffloadingConnector"])),
            module_path=draw(st.one_of(st.none(), st.just("my.mod"))),
            extra_config=draw(
                st.dictionaries(st.text("xyz", min_size=1, max_size=3), SCALARS, max_size=2)
            ),
            **({"transfer_config": future} if future else {}),
            **fields,
            **common,
        )
    name = fresh()
    children = tuple(draw(st.lists(trees(depth + 1), min_size=1, max_size=3)))
    child_names = [c.name for c in children]
    timeout = draw(st.floats(0.5, 100))
    kind = draw(st.sampled_from(["chain", "fanout", "route"]))
    if kind == "chain":
        return nodes.Chain(
            name=name,
            children=children,
            lookup_timeout_s=timeout,
            policy=draw(st.sampled_from(["first", "longest"])),
            **common,
        )
    if kind == "fanout":
        return nodes.Fanout(
            name=name,
            children=children,
            lookup_timeout_s=timeout,
            load_from=draw(st.one_of(st.none(), st.sampled_from(child_names))),
            **common,
        )
    rules = tuple(
        nodes.RouteRule(
            child=draw(st.sampled_from(child_names)),
            param=draw(st.sampled_from(["p", "q"])),
            **({"equals": draw(SCALARS)} if draw(st.booleans()) else {}),
        )
        for _ in range(draw(st.integers(0, 2)))
    )
    return nodes.Route(
        name=name,
        children=children,
        lookup_timeout_s=timeout,
        default=draw(st.sampled_from(child_names)),
        rules=rules,
        **common,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_spec_document_spec_round_trip(tree: nodes.Node) -> None:
    canonical = nodes.dump_node(tree)  # compared as dumps: they tell a set ``equals: null``
    document = document_from_tree(tree)
    assert nodes.dump_node(load_tree(document, env={}, check_vllm=False)) == canonical
    # and through YAML text
    again = load_tree(yaml.safe_load(yaml.safe_dump(document)), env={}, check_vllm=False)
    assert nodes.dump_node(again) == canonical
    # and the canonical dict form the composite hands down
    assert nodes.dump_node(nodes.parse_node(canonical)) == canonical
