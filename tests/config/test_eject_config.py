"""A child's ``eject`` rule in a config: checked with the file's line, drawn by ``explain``,
and carried to the runtime by ``vllm-args``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose.config import tree_from_extra_config
from kvcompose.tree import EjectRule

pytestmark = pytest.mark.version_neutral

TREE = """version: 1
kv_role: kv_both
tree:
  chain:
    name: tiers
    children:
      - leaf: {name: local, connector: ExampleConnector,
               extra_config: {shared_storage_path: /tmp/kv}}
      - leaf:
          name: shared
          connector: ExampleConnector
          extra_config: {shared_storage_path: /tmp/kv2}
          eject: RULE
"""


def write(tmp_path: Path, rule: str) -> str:
    path = tmp_path / "tiers.yaml"
    path.write_text(TREE.replace("RULE", rule))
    return str(path)


def test_a_bad_rule_is_named_with_its_line(run_cli, tmp_path: Path) -> None:
    code, _, err = run_cli("validate", write(tmp_path, "{failures: 0, backoff_s: -1}"))
    assert code == 1
    assert "tiers.yaml:13" in err and "eject.failures" in err


def test_explain_draws_the_rule_and_vllm_args_carries_it(run_cli, tmp_path: Path) -> None:
    path = write(tmp_path, "{failures: 2, slow_ms: 250, backoff_s: 5}")
    code, out, _ = run_cli("explain", "--offline", path)
    assert code == 0
    assert "eject after 2 failed lookups (raise or > 250 ms) for 5 s" in out
    code, out, _ = run_cli("vllm-args", "--offline", "--json", path)
    tree = tree_from_extra_config(json.loads(out)["kv_connector_extra_config"])
    assert tree.children[1].eject == EjectRule(failures=2, slow_ms=250, backoff_s=5)
    assert tree.children[0].eject is None
