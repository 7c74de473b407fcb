"""``benchmarks/fastest_slow_tier.py``'s summary: from a committed run's ``results.json`` it
gives the ratios its README section quotes and the cold contenders' against the control's,
leaves out the contenders a run did not have, and lists every request of the ``fastest``
contenders from the (uncommitted) ``requests.csv``."""

from __future__ import annotations

import csv
import importlib
import shutil
from pathlib import Path

#: a committed run of some of the contenders (no disk, longest or stitch)
RUN = "results/fastest_slow_tier/four-rounds-623ffaf"


def test_summary_of_a_run_of_some_contenders(benchmarks_on_path: Path, tmp_path: Path) -> None:
    slow_tier = importlib.import_module("fastest_slow_tier")
    shutil.copy(benchmarks_on_path / RUN / "results.json", tmp_path / "results.json")
    fields = ["contender", "id", "seed", "round", "cached_tokens", "ttft_s"]
    with (tmp_path / "requests.csv").open("w", newline="") as fh:
        rows = csv.DictWriter(fh, fieldnames=fields)
        rows.writeheader()
        rows.writerow(dict(zip(fields, ["fastest", "a", 0, 0, 256, 0.8474], strict=True)))
        rows.writerow(dict(zip(fields, ["fastest", "b", 0, 0, 896, 0.8222], strict=True)))
        rows.writerow(dict(zip(fields, ["disk", "a", 0, 0, 0, 3.0], strict=True)))

    text = slow_tier.write_summary(tmp_path, saturation=False)

    assert text == (tmp_path / "summary.md").read_text().rstrip("\n")
    # the ratios benchmarks/README.md quotes for this run
    assert "- fastest / fast-only, TTFT p50 paired by round: 1.06, 1.10, 1.06" in text
    assert "- fastest-told / fast-only, TTFT p50 paired by round: 0.96, 1.20, 1.87" in text
    # the cold contenders against the control (nothing probed, the same plans otherwise)
    control = "(the control), TTFT p50 paired by round:"
    assert f"- fastest / fastest-told {control} 1.10, 0.92, 0.57 (median 0.92)" in text
    assert f"- fastest-fast-told / fastest-told {control} 1.07, 1.00, 0.59" in text
    assert f"- fastest-told / fastest-told {control}" not in text
    # disk, longest and stitch were not run: no row, no pairing
    assert "None" not in text and "| disk |" not in text and "/ stitch" not in text
    assert "| fastest | 0/0 | 847 (256) | 822 (896) |" in text.splitlines()
