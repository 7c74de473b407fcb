"""``policy: fastest``: the plan for one request with the least predicted time to first token.

Every child was asked at the local hit ``local`` and answered where its hit ends. The plans
are what the children's range modes allow (``kvcompose.tree.ranges``), as a stitch walks
them, but in any order and with any child left out:

- recompute everything after ``local``;
- one child loads its hit (any mode);
- a stitch: segments one after the other from ``local``, each by a child that can start
  where the previous one ends (its mode and alignment), a segment of a child that can be cut
  short ending early so that another child can start on its alignment; the rest recomputed.

A plan's predicted time (``kvcompose.composite.costs``): its sync segments one after the other,
its async segments in parallel, each after its child's queue, then the prefill of what is
left. The cheapest wins; ties go to the plan found first (recompute first), so loading must
pay to be chosen. A cold child (``Costs.cold``) with another request's load awaiting its
time is left out (``Costs.usable``), and its segment, where it can be cut, ends at most
``Costs.probe_tokens`` after its start (rounded up to its alignment): its first times are
bought with short loads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvcompose.composite.costs import Costs
from kvcompose.tree.ranges import RangeSupport


@dataclass(frozen=True, slots=True)
class Hit:
    """A child's answer at ``local``: it holds the request's tokens up to ``end``."""

    child: int
    end: int
    is_async: bool


@dataclass(frozen=True, slots=True)
class Part:
    """``child`` loads ``[start, end)``."""

    child: int
    start: int
    end: int
    is_async: bool


def kind_of(segments: int) -> str:
    """A plan's kind by its number of segments (the ``plans.<kind>`` counters)."""
    return ("recompute", "load", "stitch")[min(segments, 2)]


@dataclass(frozen=True, slots=True)
class Choice:
    parts: tuple[Part, ...]
    predicted_s: float

    def describe(self, names: Sequence[str]) -> str:
        plan = " + ".join(f"{names[p.child]}[{p.start},{p.end})" for p in self.parts)
        return f"{plan or 'recompute'} {self.predicted_s * 1000:.1f} ms"


def predict(parts: Sequence[Part], num_tokens: int, local: int, costs: Costs) -> float:
    """The plan's predicted time to first token (see the module docstring)."""
    sync = 0.0
    waits = 0.0
    for p in parts:
        load = costs.loads[p.child].predict(p.end - p.start)
        if p.is_async:
            waits = max(waits, costs.queue_s(p.child) + load)
        else:
            sync += load
    end = parts[-1].end if parts else local
    return sync + waits + costs.compute_s(num_tokens - end)


def choose(
    req_id: str,
    hits: Sequence[Hit],
    local: int,
    num_tokens: int,
    supports: Sequence[RangeSupport],
    block_size: int,
    costs: Costs,
) -> tuple[Choice, list[Choice]]:
    """The cheapest plan, and every plan weighed (for the decision log)."""
    hits = [h for h in hits if costs.usable(h.child, req_id)]
    weighed = [
        Choice(parts, predict(parts, num_tokens, local, costs))
        for parts in _plans(hits, local, supports, block_size, costs)
    ]
    best = weighed[0]
    for choice in weighed[1:]:
        if choice.predicted_s < best.predicted_s:
            best = choice
    return best, weighed


def _plans(
    hits: Sequence[Hit],
    local: int,
    supports: Sequence[RangeSupport],
    block_size: int,
    costs: Costs,
) -> Iterator[tuple[Part, ...]]:
    """Every plan the range modes allow, recompute first (depth first after it)."""
    by_child = {h.child: h for h in hits}

    def extend(pos: int, parts: tuple[Part, ...]) -> Iterator[tuple[Part, ...]]:
        yield parts
        if parts and supports[parts[-1].child].mode in ("sole_owner", "last_segment"):
            return  # it loads to its own end: nothing after it
        used = {p.child for p in parts}
        any_async = any(p.is_async for p in parts)
        sync_only = any(supports[p.child].mode == "natural_end" for p in parts)
        for hit in hits:
            support = supports[hit.child]
            mode = support.mode
            if hit.child in used or hit.end <= pos:
                continue
            if mode == "sole_owner" and parts:
                continue
            if mode == "natural_end" and any_async:
                continue
            if hit.is_async and (sync_only or mode == "natural_end"):
                continue
            align = support.align or block_size
            if pos % align or pos % block_size:
                continue
            ends = _ends(hit, pos, support, by_child, used, supports, block_size)
            probe_tokens = costs.probe_tokens(hit.child)
            if probe_tokens is not None and support.can_cut:
                unit = math.lcm(align, block_size)
                probe = pos + math.ceil(probe_tokens / unit) * unit
                if hit.end > probe:
                    ends = [e for e in ends if e < probe] + [probe]
            for end in ends:
                yield from extend(end, (*parts, Part(hit.child, pos, end, hit.is_async)))

    yield from extend(local, ())


def _ends(
    hit: Hit,
    pos: int,
    support: RangeSupport,
    by_child: dict[int, Hit],
    used: set[int],
    supports: Sequence[RangeSupport],
    block_size: int,
) -> list[int]:
    """Where a segment of ``hit`` from ``pos`` may end: its hit's end, and, if it can be cut,
    the last start another unused child could take after it (on that child's alignment)."""
    ends = [hit.end]
    if support.can_cut:
        for other in by_child.values():
            if other.child == hit.child or other.child in used or other.end <= hit.end:
                continue
            step = math.lcm(supports[other.child].align or block_size, block_size)
            cut = hit.end // step * step
            if pos < cut < hit.end and cut not in ends:
                ends.append(cut)
    return ends
