"""The drift defence: every member of the installed vLLM's connector API has a rule and an
implementation in the composite. Fails when vLLM adds a member kvcompose does not handle."""

from __future__ import annotations

from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvcompose.composite import CompositeConnector, CompositeConnectorHMA
from kvcompose.composite.rules import RULES, Aggregation, public_members

DOCS = Path(__file__).resolve().parents[2] / "docs" / "concepts.md"


def vllm_members() -> set[str]:
    return public_members(KVConnectorBase_V1) | public_members(SupportsHMA)


def test_every_vllm_member_has_a_rule() -> None:
    missing = sorted(vllm_members() - set(RULES))
    assert not missing, f"vLLM connector members without an aggregation rule: {missing}"


def test_every_ruled_member_is_implemented_by_the_composite() -> None:
    """Each member is defined by the composite itself, never silently inherited."""
    own = {name for klass in (CompositeConnector, CompositeConnectorHMA) for name in vars(klass)}
    inherited_ok = {
        name for name, (rule, _) in RULES.items() if rule in (Aggregation.OWN, Aggregation.PRIVATE)
    }
    missing = sorted(set(RULES) - own - inherited_ok)
    assert not missing, f"members with a rule but no composite implementation: {missing}"


def test_members_newer_than_this_vllm_are_handled_too() -> None:
    """vLLM 0.33 added three members; the composite implements them on 0.32 as well."""
    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert name in RULES
        assert name in vars(CompositeConnector)


def test_docs_table_lists_every_rule() -> None:
    text = DOCS.read_text()
    for name, (rule, _) in RULES.items():
        assert f"| `{name}` | {rule.value} |" in text, f"docs/concepts.md lacks {name}"
