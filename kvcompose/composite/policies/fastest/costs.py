"""What loads and prefill cost, measured, for ``policy: fastest`` (scheduler side).

Three estimates, each from where it is seen:

- **a child's load**: ``seconds = latency + tokens / rate``: the leaf's ``expect_read`` prior
  (or the documented default) until one of its loads is timed by the worker half
  (``kvcompose.composite.worker_timing``), then fitted by exponentially weighted least squares
  to the timed loads alone;
- **a child's queue**: the predicted time still left of its async loads in flight (a new load
  waits behind them: loads on one child add up);
- **a cold child** (no ``expect_read``, fewer than ``PROBES`` loads timed) takes one load at
  a time, and a short one where it can be cut (``Costs.probe_tokens``: 128 tokens, then
  the shortest load at which the line its first time fitted beats computing, at most 512):
  its default prior is a guess, and a guess wrong by 100x would otherwise send every
  request looked up before its first times come back to it, each with its whole hit; two
  sizes fit its line. A first probe that beats computing even read as all rate (the worst
  case for a longer load) ends the probing (``Costs.cold``, ``Costs.usable``); so does one
  whose line loses to computing at every length up to 512. The first probe is priced at
  nothing (``Costs.free_probe``): it is bought to be timed, and its cost is bounded by
  ``probe_tokens``;
- **the engine's prefill**: tokens per second over the engine's own steps, the tokens each
  step scheduled over the time from its ``build_connector_meta`` to the next one's (the
  scheduler side sees every step), less the time its sync loads took (timed by the worker
  half, reported before the next step is scheduled: a 300 ms load stalling a step of 32
  tokens is not a prefill of 100 tokens/s), counted for steps of at least
  ``MIN_PREFILL_STEP_TOKENS``.

Simplifications, written down in docs/concepts.md: a step's time, less its sync loads', is
all its tokens' (its decodes included); a sync load's stall of the other running requests is not
charged to the plan that chose it; several async segments load in parallel.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcompose import tree as nodes
from kvcompose.tree.model import DEFAULT_READ_GBPS, DEFAULT_READ_LATENCY_MS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Weight of the newest load against the ones before (exponential forgetting).
DECAY = 0.8
#: Steps with fewer scheduled tokens (decode-only) do not measure prefill speed.
MIN_PREFILL_STEP_TOKENS = 32
#: KV bytes per token when the model's shape cannot be read (a 1B model's order).
FALLBACK_BYTES_PER_TOKEN = 32 * 1024
#: A cold child's loads are probes until this many are timed: two sizes fit a line.
PROBES = 2
#: A cold child's first probe (tokens); the next one is the shortest load longer than the
#: last at which the child's line beats computing, at most ``PROBE_GROWTH`` times this
#: (``Costs.probe_tokens``).
PROBE_TOKENS = 128
#: How much longer than the one before a cold child's next probe may be.
PROBE_GROWTH = 4
#: A ``LoadCost``'s line: setting either tells its ``Costs`` (``Costs._lines_changed``).
_LINE = frozenset(("latency_s", "tokens_per_s"))


def kv_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Bytes of KV one token takes (every layer, K and V), to turn a prior's GB/s into
    tokens per second."""
    try:
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        layers = model.get_num_layers(parallel)
        heads = model.get_num_kv_heads(parallel)
        size = model.get_head_size()
        itemsize = model.dtype.itemsize
        return max(1, 2 * layers * heads * size * itemsize)
    except Exception:  # a config without a model shape (some tests): the documented default
        return FALLBACK_BYTES_PER_TOKEN


@dataclass
class LoadCost:
    """One child's ``seconds = latency + tokens / rate``: the prior until a load is timed,
    then fitted to the timed loads alone (the newest weighing most)."""

    latency_s: float
    tokens_per_s: float
    measured: int = 0
    #: the prior was set (``expect_read``), not the documented default
    prior_given: bool = False
    #: the slowest timed load read as all rate (tokens / its seconds): a bound for longer loads
    worst_tokens_per_s: float = math.inf
    #: the tokens of the last timed load (a cold child's next probe is longer)
    last_tokens: int = 0
    # weighted sums of x = tokens, y = seconds over the timed loads
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    @property
    def cold(self) -> bool:
        """Little to go on but the documented default: no prior set, fewer than ``PROBES``
        loads timed."""
        return not self.prior_given and self.measured < PROBES

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _LINE and (changed := self.__dict__.get("_on_line_change")) is not None:
            changed()

    def watch(self, changed: Callable[[], None]) -> None:
        """Call ``changed`` whenever the line (``latency_s``, ``tokens_per_s``) is set: by
        ``observe``, or by a test or tool setting it directly."""
        object.__setattr__(self, "_on_line_change", changed)

    def predict(self, tokens: int) -> float:
        return self.latency_s + tokens / self.tokens_per_s

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.measured += 1
        self.last_tokens = tokens
        if seconds > 0:
            self.worst_tokens_per_s = min(self.worst_tokens_per_s, tokens / seconds)
        w = self._w = self._w * DECAY + 1.0
        x, y = float(tokens), seconds
        self._x = self._x * DECAY + x
        self._y = self._y * DECAY + y
        self._xx = self._xx * DECAY + x * x
        self._xy = self._xy * DECAY + x * y
        mean_x, mean_y = self._x / w, self._y / w
        var = self._xx / w - mean_x * mean_x
        cov = self._xy / w - mean_x * mean_y
        if var > 1.0 and cov > 0 and mean_y - cov / var * mean_x >= 0:
            self.tokens_per_s = var / cov
            self.latency_s = mean_y - mean_x / self.tokens_per_s
            return
        # Loads of one size (or noise) cannot tell latency from rate: keep the rate, and the
        # rest of their time is latency. Erring this way corrects itself (a child that looks
        # fast is loaded again, at other sizes); the other way (a high fixed cost read as a
        # low rate) would keep the child from ever being tried again.
        rate_s = mean_x / self.tokens_per_s
        if mean_y > rate_s:
            self.latency_s = mean_y - rate_s
        else:
            self.latency_s = 0.0
            self.tokens_per_s = mean_x / mean_y if mean_y > 0 else self.tokens_per_s * 2


@dataclass(slots=True)
class Expected:
    """A load the scheduler side gave out and expects a time for."""

    req_id: str
    child: int
    tokens: int
    predicted_s: float
    is_async: bool
    #: when it was given out; None for a sync load (only an async one's queue reads it)
    since: float | None


#: What ``Costs`` keeps of a load awaiting its time, by child and request: ``(tokens,
#: predicted_s, since)``; an ``Expected`` is made of it only when its time comes (a lookup
#: gives one out per load it plans, on the scheduler's per-request path: a tuple costs less
#: to make and to drop).
_Waiting = tuple[int, float, float | None]


@dataclass
class Costs:
    """The estimates of one ``fastest`` node, and its loads awaiting their time: per child,
    sync and async apart, by request, so that a lookup touches its child's async loads and
    its own request's, never every load in flight (4,000 requests looked up in one step)."""

    loads: list[LoadCost]
    prefill_tokens_per_s: float
    clock: Callable[[], float] = time.monotonic
    prefill_measured: int = 0
    # sync loads given out since the last ``step``, by child and request
    _sync_given: list[dict[str, _Waiting]] = field(default_factory=list)
    # sync loads given out in the step before; a step drops this table whole
    _sync_before: list[dict[str, _Waiting]] = field(default_factory=list)
    # async loads awaiting their time, by child and request
    _async_given: list[dict[str, _Waiting]] = field(default_factory=list)
    # whether ``_sync_before`` may hold a load (False: empty), so that a step without new
    # loads touches neither table
    _sync_held_before: bool = False
    # when the last step was scheduled, and its tokens (0 before the first: nothing measured);
    # two numbers, not a tuple made and dropped every step
    _last_step_at: float = 0.0
    _last_step_tokens: int = 0
    _sync_load_s: float = 0.0  # the sync loads timed since the last step was scheduled
    #: every child has a prior or ``PROBES`` timed loads (set by ``any_cold``; never unset)
    warm_for_good: bool = False
    #: derived from the children's lines, refreshed whenever one is set (``_lines_changed``),
    #: not per lookup: the fastest child's rate (a bound: no load reads faster), and whether
    #: every line has latency >= 0 and rate > 0 (every load costs something: a plan's sums
    #: only grow)
    fastest_rate: float = field(default=0.0, init=False)
    lines_bounded: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._sync_given = [{} for _ in self.loads]
        self._sync_before = [{} for _ in self.loads]
        self._async_given = [{} for _ in self.loads]
        for load in self.loads:
            load.watch(self._lines_changed)
        self._lines_changed()

    def _lines_changed(self) -> None:
        loads = self.loads
        self.fastest_rate = max((load.tokens_per_s for load in loads), default=0.0)
        self.lines_bounded = all(load.latency_s >= 0 and load.tokens_per_s > 0 for load in loads)

    @classmethod
    def for_tree(cls, tree: nodes.Chain, vllm_config: VllmConfig) -> Costs:
        bytes_per_token = kv_bytes_per_token(vllm_config)
        loads = []
        for child in tree.children:
            prior = child.expect_read if isinstance(child, nodes.Leaf) else None
            latency_ms = prior.latency_ms if prior else DEFAULT_READ_LATENCY_MS
            gbps = prior.gbps if prior else DEFAULT_READ_GBPS
            loads.append(
                LoadCost(latency_ms / 1000, gbps * 1e9 / bytes_per_token, prior_given=bool(prior))
            )
        prefill = tree.expect_prefill_tokens_per_s or nodes.DEFAULT_PREFILL_TOKENS_PER_S
        return cls(loads, prefill)

    @property
    def expected(self) -> dict[tuple[str, int], Expected]:
        """Every load awaiting its time, by (request, child) (for tests and the log)."""
        out = {}
        for tables, is_async in (
            (self._sync_before, False),
            (self._sync_given, False),
            (self._async_given, True),
        ):
            for child, waiting in enumerate(tables):
                for req_id, (tokens, predicted_s, since) in waiting.items():
                    out[req_id, child] = Expected(
                        req_id, child, tokens, predicted_s, is_async, since
                    )
        return out

    # ------------------------------------------------------------- predictions
    def queue_s(self, child: int) -> float:
        """The predicted time left of ``child``'s async loads in flight."""
        now = self.clock()
        waiting = self._async_given[child].values()  # an async load's ``since`` is always set
        return sum(max(0.0, p - (now - since)) for _, p, since in waiting)  # type: ignore[operator]

    def any_cold(self) -> bool:
        """Whether a child may be cold (``cold``): False for good once every child has its
        prior set or ``PROBES`` loads timed (``LoadCost.cold`` never comes back), so a
        lookup need not ask per child."""
        if not self.warm_for_good:
            self.warm_for_good = not any(load.cold for load in self.loads)
        return not self.warm_for_good

    def cold(self, child: int) -> bool:
        """``LoadCost.cold``, unless one probe already shows loading beats computing: its
        tokens over its whole time (latency read as rate, so a longer load can only do
        better) faster than the engine's prefill."""
        load = self.loads[child]
        if not load.cold:
            return False
        return not (load.measured and load.worst_tokens_per_s > self.prefill_tokens_per_s)

    def probe_tokens(self, child: int) -> int | None:
        """The most a cold child's next load may take (where it can be cut); None if warm.

        The first probe: ``PROBE_TOKENS``. A later one: the shortest load longer than the last
        timed one at which the child's line beats computing, at most ``PROBE_GROWTH`` times the
        first.
        One time cannot tell latency from rate, and the line it fitted reads it as latency
        (``LoadCost.observe``): if that is right, any load beyond the break-even pays, and
        the shortest one already fits the line with a second size; if the time was rate
        instead, the probe's loss grows with its length. (At a fixed 4x, the slow-tier
        benchmark's disk tier, 160 ms for 128 tokens, took its second probe at 512 tokens in
        580 ms, against about 300 ms computing them.) Whether the child is probed again is
        unchanged: its line beats computing at some length up to the cap exactly when it does
        at the cap."""
        if not self.cold(child):
            return None
        load = self.loads[child]
        if not load.measured:
            return PROBE_TOKENS
        cap = PROBE_TOKENS * PROBE_GROWTH**load.measured
        prefill, rate = self.prefill_tokens_per_s, load.tokens_per_s
        if not rate > prefill > 0 or load.latency_s < 0:
            return cap  # its line never beats computing: the probe is not bought anyway
        # latency + t / rate < t / prefill  <=>  t > latency * prefill / (1 - prefill / rate)
        beyond = load.latency_s * prefill / (1 - prefill / rate)
        pays = cap if beyond >= cap else math.floor(beyond) + 1
        return max(load.last_tokens + 1, pays)

    def free_probe(self, child: int) -> bool:
        """Whether ``child``'s probe (a segment of a cold child that can be cut, at most
        ``probe_tokens``) is priced at nothing: none of its loads has been timed, so its line
        is the default prior, a guess. Such a probe is bought to be timed: priced at the guess,
        it loses to the same plan without it (by the guess's latency, the fleet benchmark's
        local tier) and the child is never timed. Its cost is bounded: one load at a time
        (``usable``), at most ``PROBE_TOKENS``, and only until its first time comes back; the
        second probe is priced by the line that time fitted. That line reads the time as
        latency (``LoadCost.observe``), so only a first probe slow enough that the line loses
        to computing at every length up to the cap ends the probing: one time cannot tell a
        tier with a large fixed cost (which pays on longer loads) from a slow one, and the
        second probe, as short as can pay (``probe_tokens``), tells."""
        load = self.loads[child]
        return not load.prior_given and not load.measured

    def usable(self, child: int, req_id: str) -> bool:
        """Whether ``req_id``'s plans may load from ``child``: any child but a cold one; a
        cold one only while no other request's load on it awaits its time."""
        if not self.cold(child):
            return True
        sync, before = self._sync_given[child], self._sync_before[child]
        in_flight = self._async_given[child]
        return len(sync) + len(before) + len(in_flight) == (
            (req_id in sync) + (req_id in before) + (req_id in in_flight)
        )

    def compute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    # ------------------------------------------------------------ bookkeeping
    def expect(
        self, req_id: str, child: int, tokens: int, predicted_s: float, is_async: bool
    ) -> None:
        if is_async:
            self._async_given[child][req_id] = (tokens, predicted_s, self.clock())
        else:  # its time comes with its step's output: nothing waits on it, no clock read
            self._sync_given[child][req_id] = (tokens, predicted_s, None)

    def forget(self, req_id: str, *, in_flight_only: bool = False) -> None:
        """The request's loads will not be timed (a 0 grant; a finish before an async load's
        receive, or a receive that came without a time: the load failed; a sync load's time
        still comes with its step's output). Only the children
        with loads awaiting their time are looked at (every lookup and finish calls this)."""
        if any(self._async_given):  # (the common finish: no async load awaits a time)
            for waiting in self._async_given:
                if waiting:
                    waiting.pop(req_id, None)
        if not in_flight_only:
            for waiting in self._sync_given:
                if waiting:
                    waiting.pop(req_id, None)
            for waiting in self._sync_before:
                if waiting:
                    waiting.pop(req_id, None)

    def timed(self, times: Mapping[tuple[str, int], float]) -> list[tuple[Expected, float]]:
        """The worker half's times of loads: each fits its child's estimate. Returns the
        (expected, seconds) pairs for the decision log and metrics."""
        done = []
        for (req_id, child), seconds in times.items():
            if not 0 <= child < len(self.loads):
                continue
            waiting = self._sync_given[child].pop(req_id, None)
            if waiting is None:
                waiting = self._sync_before[child].pop(req_id, None)
            is_async = waiting is None
            if is_async:
                waiting = self._async_given[child].pop(req_id, None)
            if waiting is not None:
                tokens, predicted_s, since = waiting
                self.loads[child].observe(tokens, seconds)
                done.append(
                    (Expected(req_id, child, tokens, predicted_s, is_async, since), seconds)
                )
                if not is_async:
                    self._sync_load_s += seconds
        return done

    def step(self, scheduled_tokens: int) -> None:
        """A step was scheduled with ``scheduled_tokens``: the previous one's time is known."""
        now = self.clock()
        tokens = self._last_step_tokens
        if tokens >= MIN_PREFILL_STEP_TOKENS:
            elapsed = now - self._last_step_at - self._sync_load_s
            if elapsed > 0:
                # the first measurement halves the prior's weight, later ones move it by 1/5
                alpha = 0.5 if not self.prefill_measured else 1 - DECAY
                self.prefill_tokens_per_s += alpha * (tokens / elapsed - self.prefill_tokens_per_s)
                self.prefill_measured += 1
        self._last_step_at = now
        self._last_step_tokens = scheduled_tokens
        self._sync_load_s = 0.0
        # a sync load's time came with its step's output, or never will (its child raised):
        # those given out before the previous step are dropped, a table at a time (nothing to
        # move in a step without new loads: this runs every step, with cold caches)
        given = any(self._sync_given)
        if given or self._sync_held_before:
            self._sync_before = self._sync_given
            self._sync_given = [{} for _ in self.loads]
            self._sync_held_before = given
