"""docs/config.md is generated from the schema; this keeps it in sync."""

from __future__ import annotations

from config_helpers import ROOT

from kvcompose.config.docs import render_markdown
from kvcompose.tree import Chain, Document, Fanout, Leaf, Route, RouteRule


def test_docs_config_md_is_up_to_date() -> None:
    current = (ROOT / "docs" / "config.md").read_text()
    assert current == render_markdown(), (
        "docs/config.md is stale: regenerate it with "
        "`.venv/bin/python -m kvcompose.cli schema --markdown -o docs/config.md`"
    )


def test_every_field_is_documented() -> None:
    text = render_markdown()
    for model in (Document, Leaf, Chain, Fanout, Route, RouteRule):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            assert f"| `{name}` |" in text
