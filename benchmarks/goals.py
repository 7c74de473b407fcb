"""The default comparison's goals, measured from a ``results.json`` of ``kvcompose bench``.

    python benchmarks/goals.py [RESULTS_JSON]    # default: results/default/results.json

Goals (set when the default comparison was built):

- a tier hit makes TTFT p50 at least 5x better than recompute;
- kvcompose ``longest`` loads at least as many tokens as vLLM's MultiConnector over the same
  tiers (strictly more where the tiers' coverage differs);
- 100 % greedy-output agreement with recompute;
- kvcompose ``fastest`` within noise of ``longest`` where every tier reads faster than the
  engine computes: its TTFT p50 speedup over recompute at least 0.95x longest's.

Prints one line per goal; the exit status is 1 when one is not met.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvcompose.bench.results import BenchResults

DEFAULT = Path(__file__).resolve().parent / "results" / "default" / "results.json"
SPEEDUP_TARGET = 5.0
FASTEST_VS_LONGEST = 0.95


def goals(results: BenchResults) -> dict[str, Any]:
    """The goals this set of contenders can answer, measured."""
    ran = [c for c in results.contenders if c.ran]
    out: dict[str, Any] = {}
    speedups = {c.label: c.ttft_p50_speedup for c in ran if c.ttft_p50_speedup and c.kind != "none"}
    if speedups:
        best = max(speedups, key=lambda k: speedups[k] or 0.0)
        out["tier_ttft_p50_speedup"] = {
            "target": SPEEDUP_TARGET,
            "best_contender": best,
            "best": speedups[best],
            "by_contender": speedups,
            "met": (speedups[best] or 0.0) >= SPEEDUP_TARGET,
        }
    multi = [c for c in ran if c.connector == "MultiConnector" and c.kind == "vllm"]
    longest = [c for c in ran if c.kind == "kvcompose" and c.policy == "longest"]
    if multi and longest and multi[0].hits and longest[0].hits:
        m, lg = multi[0], longest[0]
        mt, lt = m.hits.tokens_loaded, lg.hits.tokens_loaded
        out["longest_vs_multiconnector_hit_tokens"] = {
            "multiconnector": m.label,
            "longest": lg.label,
            "multiconnector_tokens": mt,
            "longest_tokens": lt,
            "ratio": round(lt / mt, 3) if mt else None,
            "met": lt >= mt,
            "strictly_more": lt > mt,
        }
    fastest = [c for c in ran if c.kind == "kvcompose" and c.policy == "fastest"]
    if fastest and longest and fastest[0].ttft_p50_speedup and longest[0].ttft_p50_speedup:
        ratio = fastest[0].ttft_p50_speedup / longest[0].ttft_p50_speedup
        out["fastest_vs_longest_speedup"] = {
            "target": FASTEST_VS_LONGEST,
            "ratio": round(ratio, 3),
            "met": ratio >= FASTEST_VS_LONGEST,
        }
    agree = {c.label: c.agreement.percent for c in ran if c.agreement}
    if agree:
        out["output_agreement_percent"] = {
            "target": 100.0,
            "by_contender": agree,
            "met": all(v == 100.0 for v in agree.values()),
        }
    failed = [c.label for c in results.contenders if not c.ran]
    if failed:
        out["failed_contenders"] = failed
    return out


def lines(measured: dict[str, Any]) -> list[str]:
    """One line per goal."""
    out = []
    s = measured.get("tier_ttft_p50_speedup")
    if s:
        out.append(
            f"TTFT p50 vs recompute: best {s['best']:.1f}x ({s['best_contender']}); "
            f"goal >= {s['target']:.0f}x: {'met' if s['met'] else 'NOT met'}"
        )
    lm = measured.get("longest_vs_multiconnector_hit_tokens")
    if lm:
        out.append(
            f"hit tokens: {lm['longest']} {lm['longest_tokens']:,} vs "
            f"{lm['multiconnector']} {lm['multiconnector_tokens']:,}; goal >=: "
            f"{'met' if lm['met'] else 'NOT met'}"
            f"{' (strictly more)' if lm['strictly_more'] else ''}"
        )
    fl = measured.get("fastest_vs_longest_speedup")
    if fl:
        out.append(
            f"fastest's speedup over recompute / longest's: {fl['ratio']:.2f}; goal >= "
            f"{fl['target']:.2f}: {'met' if fl['met'] else 'NOT met'}"
        )
    a = measured.get("output_agreement_percent")
    if a:
        worst = min(a["by_contender"].values())
        out.append(
            f"greedy output agreement with recompute: lowest {worst}%; goal 100%: "
            f"{'met' if a['met'] else 'NOT met'}"
        )
    if measured.get("failed_contenders"):
        out.append(f"failed contenders: {', '.join(measured['failed_contenders'])}")
    return out


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DEFAULT
    measured = goals(BenchResults.model_validate_json(path.read_text()))
    for line in lines(measured):
        print(line)
    met = all(g.get("met", True) for g in measured.values() if isinstance(g, dict))
    return 0 if met and not measured.get("failed_contenders") else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
