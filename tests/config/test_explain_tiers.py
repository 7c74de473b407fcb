"""``kvcompose explain`` shows each kvcompose store tier's medium, capacity, admission rule
and promotion target."""

from __future__ import annotations

from config_helpers import EXAMPLES

HIERARCHY = EXAMPLES / "cache-hierarchy.yaml"


def test_explain_shows_each_tiers_capacity_admission_and_promotion(run_cli) -> None:
    code, out, err = run_cli("explain", "--offline", str(HIERARCHY))
    assert code == 0, err
    text = " ".join(out.split())  # rich wraps long lines
    assert "medium: tmpfs; capacity: 2 GiB (evicts least recently used; first chunks last)" in text
    assert "admission: chunks seen >= 2 times; written by a background writer" in text
    assert "promotion: saves what disk load, past its admission rule" in text
    assert "medium: disk; capacity: 100 GiB" in text
    assert "admission: every save; written by a background writer" in text
    assert "its loads are promoted into: ram" in text


def test_explain_labels_an_emulated_slow_tier(run_cli, tmp_path) -> None:
    text = HIERARCHY.read_text().replace(
        "            medium: disk\n",
        "            medium: disk\n            emulate_read: {latency_ms: 2.5, gbps: 1.5}\n",
    )
    assert "emulate_read" in text
    path = tmp_path / "emulated.yaml"
    path.write_text(text)
    code, out, err = run_cli("explain", "--offline", str(path))
    assert code == 0, err
    flat = " ".join(out.split())
    assert (
        "EMULATED slow reads: every load takes at least 2.5 ms + bytes / 1.5 GB/s (sleeps "
        "after the real read; for benchmarks)" in flat
    )
    assert flat.count("EMULATED") == 1  # the disk tier only
