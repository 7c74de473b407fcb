"""``kvcompose explain`` shows each kvcompose store tier's medium, capacity, admission rule
and promotion target."""

from __future__ import annotations

from config_helpers import EXAMPLES

HIERARCHY = EXAMPLES / "cache-hierarchy.yaml"


def test_explain_shows_each_tiers_capacity_admission_and_promotion(run_cli) -> None:
    code, out, err = run_cli("explain", "--offline", str(HIERARCHY))
    assert code == 0, err
    text = " ".join(out.split())  # rich wraps long lines
    assert (
        "medium: tmpfs; capacity: 2.0 GiB (evicts least recently used; first chunks last)" in text
    )
    assert "admission: chunks seen >= 2 times; written by a background writer" in text
    assert "promotion: saves what disk load, past its admission rule" in text
    assert "medium: disk; capacity: 100.0 GiB" in text
    assert "admission: every save; written by a background writer" in text
    assert "its loads are promoted into: ram" in text
