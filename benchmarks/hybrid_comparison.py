"""The default comparison on the hybrid model, beside the plain model: ``results/default_hybrid``.

    flock /tmp/kvcompose-engine.lock python benchmarks/hybrid_comparison.py [kvcompose bench args]

runs the default comparison of ``kvcompose bench`` (its contenders, chat workload and rounds)
twice, one model after the other: ``builtin-hybrid`` (the builtin Llama with every other layer
sliding over a 256-token window: 2 KV cache groups under vLLM's hybrid KV cache manager) into
``OUT/hybrid``, then the plain ``builtin`` into ``OUT/plain``. Every table row carries the KV
cache blocks vLLM allocated and whether HMA stayed on, read from each contender's engine.
Then ``write_summary`` measures the goals into ``OUT/summary.md``:

- ``longest`` and ``stitch`` at least as far ahead of recompute on the hybrid model as on the
  plain one: the hybrid run's median TTFT p50 ratio to recompute (paired within its rounds)
  at least the low end of the plain run's range;
- the store's bytes per loaded token on the hybrid model at most the plain model's, for every
  contender that loads (a sliding layer's KV is read for its window only);
- 100 % greedy-output agreement with recompute on both models.

``results.json``, ``results.csv`` and ``summary.png`` of both runs and ``summary.md`` are
committed; the rest is ignored (``benchmarks/.gitignore``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "default_hybrid"
MODELS = {"hybrid": "builtin-hybrid", "plain": "builtin"}
#: the policies whose lead over recompute is compared between the models
COMPARED = ("kvcompose-longest", "kvcompose-stitch")


def _load(path: Path) -> Any:
    from kvcompose.bench.results import BenchResults

    return BenchResults.model_validate_json(path.read_text())


def bytes_per_loaded_token(contender: Any) -> float | None:
    """The stores' bytes loaded over their tokens loaded, in one replay (None: nothing
    loaded)."""
    stores = contender.hits.stores.values() if contender.hits else ()
    tokens = sum(s.tokens_loaded for s in stores)
    return sum(s.bytes_loaded for s in stores) / tokens if tokens else None


def measure(hybrid: Any, plain: Any) -> dict[str, Any]:
    """The goals, measured from the two runs' ``results.json``."""
    rows = []
    by_label = {c.label: c for c in plain.contenders}
    for h in hybrid.contenders:
        p = by_label.get(h.label)
        if p is None or not h.ran or not p.ran:
            continue
        rows.append(
            {
                "contender": h.label,
                "kv_blocks": (_kv(h, "num_blocks"), _kv(p, "num_blocks")),
                "hma": (_kv(h, "hma"), _kv(p, "hma")),
                "groups": (len(_kv(h, "groups") or []), len(_kv(p, "groups") or [])),
                "speedup": (_span(h), _span(p)),
                "bytes_per_token": (bytes_per_loaded_token(h), bytes_per_loaded_token(p)),
                "agreement": (
                    h.agreement.percent if h.agreement else None,
                    p.agreement.percent if p.agreement else None,
                ),
                "tokens_loaded": (
                    h.hits.tokens_loaded if h.hits else 0,
                    p.hits.tokens_loaded if p.hits else 0,
                ),
            }
        )
    lead = {}
    for r in rows:
        if r["contender"] in COMPARED:
            (hmed, _, _), (_, plow, _) = r["speedup"]
            lead[r["contender"]] = hmed is not None and plow is not None and hmed >= plow
    loads = [r for r in rows if r["bytes_per_token"][0] and r["bytes_per_token"][1]]
    agree = [v for r in rows for v in r["agreement"] if v is not None]
    return {
        "rows": rows,
        "goals": {
            "lead_over_recompute": lead,
            "bytes_per_loaded_token": {
                r["contender"]: r["bytes_per_token"][0] <= r["bytes_per_token"][1] for r in loads
            },
            "agreement_100": bool(agree) and all(v == 100.0 for v in agree),
        },
    }


def _kv(contender: Any, key: str) -> Any:
    return getattr(contender.kv_cache, key) if contender.kv_cache else None


def _span(contender: Any) -> tuple[float | None, float | None, float | None]:
    rounds = contender.speedup_rounds
    if not rounds:
        return contender.ttft_p50_speedup, None, None
    return statistics.median(rounds), min(rounds), max(rounds)


def _x(span: tuple[float | None, float | None, float | None]) -> str:
    med, low, high = span
    if med is None:
        return "-"
    return f"{med:.1f}x" + (f" ({low:.1f}-{high:.1f})" if low is not None else "")


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def write_summary(out: Path) -> str:
    """``summary.md`` from ``out/hybrid/results.json`` and ``out/plain/results.json``."""
    hybrid, plain = (_load(out / name / "results.json") for name in MODELS)
    m = measure(hybrid, plain)
    lines = [
        "# The default comparison on the hybrid model, beside the plain model",
        "",
        f"`python benchmarks/hybrid_comparison.py`: {hybrid.meta.repeats} rounds per model, "
        f"the order of the contenders rotated; chat workload, "
        f"{hybrid.meta.workload.get('requests')} requests a round. Hybrid: "
        f"`{MODELS['hybrid']}`; plain: `{MODELS['plain']}`. KV cache blocks and HMA are read "
        "from each contender's engine. vs recompute: TTFT p50 ratio within each round, median "
        "(range).",
        "",
        "| contender | KV blocks hybrid (groups) | HMA hybrid | KV blocks plain | "
        "vs recompute hybrid | vs recompute plain | tokens loaded hybrid / plain | "
        "bytes per loaded token hybrid / plain | agreement % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in m["rows"]:
        hb, pb = r["bytes_per_token"]
        bpt = "-" if hb is None else f"{hb:,.0f} / {pb:,.0f}"
        blocks = "-" if r["kv_blocks"][0] is None else f"{r['kv_blocks'][0]:,} ({r['groups'][0]})"
        lines.append(
            f"| {r['contender']} | {blocks} | "
            f"{'on' if r['hma'][0] else 'off'} | "
            f"{'-' if r['kv_blocks'][1] is None else format(r['kv_blocks'][1], ',')} | "
            f"{_x(r['speedup'][0])} | {_x(r['speedup'][1])} | "
            f"{r['tokens_loaded'][0]:,} / {r['tokens_loaded'][1]:,} | {bpt} | "
            f"{r['agreement'][0]} / {r['agreement'][1]} |"
        )
    g = m["goals"]
    lines += ["", "Goals:", ""]
    for label, ok in g["lead_over_recompute"].items():
        lines.append(
            f"- {label} at least as far ahead of recompute on the hybrid model (its median at "
            f"least the plain run's low end): {_met(ok)}"
        )
    worse = [k for k, ok in g["bytes_per_loaded_token"].items() if not ok]
    lines.append(
        "- store bytes per loaded token on the hybrid model at most the plain model's, for "
        f"every contender that loads: {_met(not worse)}"
        + (f" (not for {', '.join(worse)})" if worse else "")
    )
    lines.append(f"- 100 % greedy-output agreement on both models: {_met(g['agreement_100'])}")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    return text


def main(argv: list[str]) -> int:
    from kvcompose.cli.main import main as cli

    rc = 0
    for name, model in MODELS.items():
        rc = max(rc, cli(["bench", "--model", model, "--out", str(OUT / name), *argv]))
    print(write_summary(OUT))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
