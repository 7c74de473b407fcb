"""``overhead.json``, the scheduler-overhead benchmark's result, as typed records."""

from __future__ import annotations

from typing import Any

from kvcompose.bench.results import Record


class OverheadRow(Record):
    """One configuration (best round): µs per request and engine step unless named."""

    in_connector_us_per_request_step: float
    connector_calls: int
    total_ms: float
    us_per_request_step: float
    added_us_per_request_step: float
    added_us_per_request_admit: float
    added_us_per_request_decode_step: float
    added_us_per_request_finish: float
    runs_total_ms: list[float]
    runs_in_connector_ms: list[float]
    in_connector_us_per_request_by_method: dict[str, float]
    #: prompt tokens the admission step computed per request: the prompt less the
    #: connectors' hit (results since 2026-12-02 evening; older files have none)
    computed_tokens_per_request: float | None = None


class OverheadRatios(Record):
    """In-connector time ratios, medians over rounds of within-round ratios (``*_rounds``:
    the ratio in each round, for the spread)."""

    kvcompose_over_multiconnector: float | None
    kvcompose_over_direct: float | None
    multiconnector_over_direct: float | None
    kvcompose_no_slower_than_multiconnector: bool
    end_to_end_added_kvcompose_over_multiconnector: float | None
    kvcompose_over_multiconnector_rounds: list[float] = []
    kvcompose_over_direct_rounds: list[float] = []
    multiconnector_over_direct_rounds: list[float] = []
    #: against ``floor-k``, the barest composite of the same children (results since
    #: 2026-12-02; older files have none)
    kvcompose_over_floor: float | None = None
    floor_over_direct: float | None = None
    kvcompose_over_floor_rounds: list[float] = []
    floor_over_direct_rounds: list[float] = []
    #: ``fastest-k`` against ``longest-k``, chains over k children that hit (issue 27's
    #: overhead goal; results since 2026-12-02 evening; older files have none)
    fastest_over_longest: float | None = None
    fastest_over_longest_rounds: list[float] = []


class OverheadEntry(Record):
    steps: int
    configs: dict[str, OverheadRow]
    ratios: dict[str, OverheadRatios]


class OverheadMeta(Record):
    options: dict[str, Any]
    model: str
    vllm: str | None
    python: str
    cpus: int | None
    duration_s: float | None = None


class OverheadResult(Record):
    """``overhead.json``: per number of concurrent requests."""

    meta: OverheadMeta
    by_requests: dict[str, OverheadEntry]
