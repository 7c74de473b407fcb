"""``benchmarks/fastest_slow_tier.py``'s summary: from the committed run's ``results.json`` it
gives the committed ``summary.md``'s table and ratios, pairs the cold contenders with the
control, leaves out the contenders a run did not have, and lists every request of the
``fastest`` contenders from the (uncommitted) ``requests.csv``."""

from __future__ import annotations

import csv
import importlib
import json
import shutil
from pathlib import Path

#: the committed run: every contender, 3 rounds
RUN = "results/fastest_slow_tier"


def test_summary_of_the_committed_run(benchmarks_on_path: Path, tmp_path: Path) -> None:
    slow_tier = importlib.import_module("fastest_slow_tier")
    shutil.copy(benchmarks_on_path / RUN / "results.json", tmp_path / "results.json")

    text = slow_tier.write_summary(tmp_path, saturation=False)

    assert text == (tmp_path / "summary.md").read_text().rstrip("\n")
    # without requests.csv there are no per-request rows; the rest is the committed summary's
    committed = (benchmarks_on_path / RUN / "summary.md").read_text()
    assert "Per request" not in text
    assert committed.startswith(text + "\n")
    assert "- fastest / fast-only, TTFT p50 paired by round: 1.08, 1.04, 1.11" in text
    assert "- fastest / longest, TTFT p50 paired by round: 0.48, 0.49, 0.42" in text


def test_summary_of_a_run_of_some_contenders(benchmarks_on_path: Path, tmp_path: Path) -> None:
    slow_tier = importlib.import_module("fastest_slow_tier")
    run = json.loads((benchmarks_on_path / RUN / "results.json").read_text())
    run["contenders"] = [
        c for c in run["contenders"] if c["label"] not in ("disk", "longest", "stitch")
    ]
    (tmp_path / "results.json").write_text(json.dumps(run))
    fields = ["contender", "id", "seed", "round", "cached_tokens", "ttft_s"]
    with (tmp_path / "requests.csv").open("w", newline="") as fh:
        rows = csv.DictWriter(fh, fieldnames=fields)
        rows.writeheader()
        rows.writerow(dict(zip(fields, ["fastest", "a", 0, 0, 256, 0.8474], strict=True)))
        rows.writerow(dict(zip(fields, ["fastest", "b", 0, 0, 896, 0.8222], strict=True)))
        rows.writerow(dict(zip(fields, ["disk", "a", 0, 0, 0, 3.0], strict=True)))

    text = slow_tier.write_summary(tmp_path, saturation=False)

    assert text == (tmp_path / "summary.md").read_text().rstrip("\n")
    assert "- fastest / fast-only, TTFT p50 paired by round: 1.08, 1.04, 1.11" in text
    assert "- fastest-told / fast-only, TTFT p50 paired by round: 0.96, 0.79, 0.88" in text
    # the cold contenders against the control (nothing probed, the same plans otherwise)
    control = "(the control), TTFT p50 paired by round:"
    assert f"- fastest / fastest-told {control} 1.12, 1.33, 1.27 (median 1.27)" in text
    assert f"- fastest-fast-told / fastest-told {control} 1.02, 1.18, 1.11" in text
    assert f"- fastest-told / fastest-told {control}" not in text
    # disk, longest and stitch were not run: no row, no pairing
    assert "None" not in text and "| disk |" not in text and "/ stitch" not in text
    assert "| fastest | 0/0 | 847 (256) | 822 (896) |" in text.splitlines()
