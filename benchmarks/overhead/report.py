"""The scheduler-overhead benchmark's result as a rich table (the console) and as Markdown
(``overhead.md``); the measuring is in ``overhead.measure``."""

from __future__ import annotations

from typing import Any

from overhead.results import OverheadRatios, OverheadResult


def table(result: OverheadResult) -> Any:
    from rich.table import Table

    t = Table(
        title="scheduler-side overhead on vLLM's real scheduler, no-op children (best of "
        "repeats; µs per request per engine step)",
        title_justify="left",
    )
    for col in (
        "N",
        "config",
        "in connector µs",
        "step total µs",
        "added vs none µs",
        "admit +µs/req",
        "decode +µs",
        "finish +µs/req",
    ):
        t.add_column(col, justify="left" if col == "config" else "right")
    for n, entry in result.by_requests.items():
        for name, row in entry.configs.items():
            t.add_row(
                n,
                name,
                f"{row.in_connector_us_per_request_step:.3f}",
                f"{row.us_per_request_step:.2f}",
                f"{row.added_us_per_request_step:.2f}",
                f"{row.added_us_per_request_admit:.2f}",
                f"{row.added_us_per_request_decode_step:.2f}",
                f"{row.added_us_per_request_finish:.2f}",
            )
        for k, r in entry.ratios.items():
            kvc_mc, kvc_direct, mc_direct, kvc_floor, floor_direct, fastest_longest = _ratio_cells(
                r
            )
            t.add_row(
                n,
                f"ratio, {k.replace('_', ' ')}",
                f"kvc/MC {kvc_mc}",
                f"kvc/direct {kvc_direct}",
                f"MC/direct {mc_direct}",
                f"kvc/floor {kvc_floor}",
                f"floor/direct {floor_direct}",
                f"fastest/longest {fastest_longest}",
            )
    return t


def _ratio_cells(r: OverheadRatios) -> tuple[str, str, str, str, str, str]:
    """kvcompose/MultiConnector, kvcompose/direct, MultiConnector/direct, kvcompose/floor,
    floor/direct, fastest/longest, with spreads."""
    return (
        _spread(r.kvcompose_over_multiconnector, r.kvcompose_over_multiconnector_rounds),
        _spread(r.kvcompose_over_direct, r.kvcompose_over_direct_rounds),
        _spread(r.multiconnector_over_direct, r.multiconnector_over_direct_rounds),
        _spread(r.kvcompose_over_floor, r.kvcompose_over_floor_rounds),
        _spread(r.floor_over_direct, r.floor_over_direct_rounds),
        _spread(r.fastest_over_longest, r.fastest_over_longest_rounds),
    )


def _spread(median: float | None, rounds: list[float]) -> str:
    """``median (min-max over rounds)``."""
    if median is None:
        return "n/a"
    if not rounds:
        return f"{median:.2f}"
    return f"{median:.2f} ({min(rounds):.2f}-{max(rounds):.2f})"


def markdown(result: OverheadResult, goals: str = "") -> str:
    """``overhead.md``: the in-connector ratios, median (range) over the rounds of ratios
    taken within a round, and the per-configuration times. ``goals``, a sentence a
    benchmark script sets its targets in, follows the header (the library holds none)."""
    opts = result.meta.options
    lines = [
        "# Scheduler-side overhead (in-connector time, no-op children)",
        "",
        f"vLLM {result.meta.vllm}, Python {result.meta.python}, {result.meta.cpus} CPUs; "
        f"{opts.get('repeats')} rounds, each running every configuration interleaved step by "
        f"step; {opts.get('steps')} decode steps. Ratios: median (min-max) over the rounds of "
        f"the ratio measured within a round.{' ' + goals if goals else ''}",
        "",
        "`floor-k` is `benchmarks/overhead/floor.py`'s `FloorConnector`, a bare forwarding "
        "composite of the same k children (each asked and told everything, nothing kept or "
        "checked): `floor / direct` is what forwarding to k children costs, "
        "`kvcompose / floor` about kvcompose's own share. `longest-k` and `fastest-k` are "
        "kvcompose chains over k children that hit (child i holds the prompt less i + 1 "
        "blocks; `fastest` with an `expect_read` prior on each, so every request goes through "
        "its plan choice): `fastest / longest` is what choosing a plan by predicted cost "
        "costs against taking the longest hit.",
        "",
        "| N | children | kvcompose / MultiConnector | kvcompose / direct | "
        "MultiConnector / direct | kvcompose / floor | floor / direct | fastest / longest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, entry in result.by_requests.items():
        for k, r in entry.ratios.items():
            lines.append(f"| {n} | {k.split('_')[0]} | " + " | ".join(_ratio_cells(r)) + " |")
    lines += [
        "",
        "In-connector µs per request and engine step (best round):",
        "",
        "| N | config | in connector µs | calls | prompt tokens computed per request |",
        "|---|---|---|---|---|",
    ]
    for n, entry in result.by_requests.items():
        for name, row in entry.configs.items():
            if name != "none":
                computed = row.computed_tokens_per_request
                lines.append(
                    f"| {n} | {name} | {row.in_connector_us_per_request_step:.4f} "
                    f"| {row.connector_calls} | {'' if computed is None else f'{computed:g}'} |"
                )
    return "\n".join(lines) + "\n"
