"""Every kvcompose config shown in the documentation is valid, so the docs cannot rot.

Scans the fenced code blocks of README.md, docs/*.md, benchmarks/README.md and the examples'
Markdown. A YAML or JSON block that is a kvcompose document (a ``tree``), a MultiConnector
config (``connectors``) or a ``--kv-transfer-config`` loading KVCompose must load without
error; a Python block that builds a tree with ``kvcompose.tree`` must run, and the
``kv_transfer_config`` it makes must load. Blocks with ``...`` placeholders are excerpts and
are skipped, as are lists of nodes shown one per line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.config import load_config, tree_from_extra_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "examples").rglob("*.md"),
    ]
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
COMPOSITES = {"KVCompose", "KVComposeHMA", "MultiConnector"}


def blocks(lang: set[str]) -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) in lang:
                line = text[: match.start()].count("\n") + 1
                out.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return out


def is_config(data: Any) -> bool:
    return isinstance(data, dict) and (
        "tree" in data or "connectors" in data or data.get("kv_connector") in COMPOSITES
    )


def parse(body: str) -> Any:
    """JSON, YAML, or JSON Lines (a list of objects); a block none of them reads fails."""
    try:
        return yaml.safe_load(body)
    except yaml.YAMLError:
        return [json.loads(line) for line in body.splitlines() if line.strip()]


CONFIGS = [(where, body) for where, body in blocks({"yaml", "json"}) if "..." not in body]
TREE_SNIPPETS = [
    (where, body) for where, body in blocks({"python"}) if "from kvcompose.tree import" in body
]


def test_the_docs_show_configs() -> None:
    shown = [where for where, body in CONFIGS if is_config(parse(body))]
    assert len(shown) >= 2, shown  # the README's tiers example and docs/config.md's
    assert TREE_SNIPPETS, "docs/concepts.md builds a tree in Python"


@pytest.mark.parametrize(("where", "body"), CONFIGS, ids=[w for w, _ in CONFIGS])
def test_config_block_loads(where: str, body: str) -> None:
    data = parse(body)
    if not is_config(data):
        pytest.skip("not a kvcompose config (e.g. a list of nodes or a stats payload)")
    config = load_config(data, env={}, check_vllm=False)
    assert config.tree.name


@pytest.mark.parametrize(("where", "body"), TREE_SNIPPETS, ids=[w for w, _ in TREE_SNIPPETS])
def test_python_tree_snippet_runs(where: str, body: str) -> None:
    scope: dict[str, Any] = {}
    exec(compile(body, where, "exec"), scope)
    transfer = scope.get("kv_transfer_config")
    if transfer is not None:
        assert tree_from_extra_config(
            transfer["kv_connector_extra_config"], env={}, check_vllm=False
        ).name
