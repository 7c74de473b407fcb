"""The runtime (``kvcompose.composite``) reads only validated trees; reading user configs is
the entry classes' job (``kvcompose.KVCompose``, ``kvcompose.compat.MultiConnector``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcompose import tree as nodes
from kvcompose.compat import MultiConnector
from kvcompose.composite import CompositeConnector
from kvcompose.connector import KVCompose

MULTICONNECTOR_FORM = {
    "connectors": [
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kvcompose-unused"},
        }
    ]
}


@pytest.mark.vllm_process
def test_the_runtime_imports_no_config_cli_or_bench() -> None:
    code = (
        "import sys, kvcompose.composite.node, kvcompose.connector, kvcompose.compat\n"
        "print(sorted(m for m in sys.modules if m.startswith(('kvcompose.config', "
        "'kvcompose.cli', 'kvcompose.bench', 'kvcompose.testing'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_runtime_refuses_a_user_config_and_names_the_entry_class() -> None:
    with pytest.raises(ValueError, match=r"no 'kvcompose_tree'.*kvcompose\.KVCompose"):
        CompositeConnector.tree_from_config(MULTICONNECTOR_FORM)


@pytest.mark.parametrize("entry", [KVCompose, MultiConnector])
def test_entry_classes_read_user_configs_and_the_internal_form_alike(entry: type) -> None:
    tree = entry.tree_from_config(MULTICONNECTOR_FORM)
    assert isinstance(tree, nodes.Chain)
    assert [leaf.connector for leaf in nodes.leaves(tree)] == ["ExampleConnector"]
    internal = {nodes.TREE_KEY: nodes.dump_node(tree)}
    assert entry.tree_from_config(internal) == CompositeConnector.tree_from_config(internal)
