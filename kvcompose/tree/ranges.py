"""How a leaf can take part in a stitched load (``chain`` with ``policy: stitch``).

A stitched load reads one request's KV from several children, each its own token range
``[start, end)``. vLLM's connector API has no way to hand a connector a range (the upstream
proposal, vllm#54240 "range-aware" MultiConnector, declares ``supports_load_range`` and
``load_range_alignment`` per connector; still open), so each connector can only take part the
way its own lookup and allocation already work. The modes, from what the installed vLLM
0.32/0.33 sources do (``docs/concepts.md``, "Stitched loads", has the table and how a
stitch uses it):

- ``native``: looked up at ``a``, it answers the tokens it holds after ``a`` and, told ``n``
  with the request's full blocks, loads exactly ``[a, a + n)`` by absolute block position;
  any segment, and can be cut short (``n`` smaller than its hit). kvcompose's
  ``PrefixStoreConnector``; vLLM's ``OffloadingConnector`` searches from chunk ``a // chunk``
  (``OffloadingConnectorScheduler._lookup_complete_chunks``) and loads by absolute
  position, async; vLLM's ``MooncakeStoreConnector`` too (tests/fleet). Neither can be cut:
  each asserts it is told what it offered. LMCache's ``LMCacheMPConnector`` (tests/lmcache_mp)
  retrieves ``[a, its hit end)`` whatever ``n > 0`` it is told (``GetRetrieveMetadata``), so
  it cannot be cut either.
- ``last_segment``: loads from its lookup argument to its own end and cannot be cut, so only
  as the last segment; it is handed a block view that starts at the segment's first block.
  vLLM's ``NixlConnector`` (decode side, pull) loads
  ``blocks.get_unhashed_block_ids_all_groups()`` (``NixlPullConnectorScheduler.
  update_state_after_alloc``) and its worker keeps the last ``len(local)`` remote blocks,
  so a view starting at ``a`` pulls exactly ``[a, end)``.
- ``natural_end``: only ``[a, its own end)``, sync, with ``a`` on its chunk size; no async
  segment may join the stitch. LMCache's adapter (sync, asserts ``n == end - a``).
- ``sole_owner``: loads its whole hit whatever it is told; only when it is the one segment.
  vLLM's ``ExampleConnector`` (its ``build_connector_meta`` loads every block of the
  prompt) and every connector kvcompose knows nothing about.

A leaf may override its mode (``load_range``) and start alignment (``load_range_alignment``)
in the tree; the table below is the default, by connector class name. Pure data: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RangeMode = Literal["native", "last_segment", "natural_end", "sole_owner"]
RANGE_MODES: tuple[str, ...] = ("native", "last_segment", "natural_end", "sole_owner")

#: LMCache's default chunk size (tokens), the alignment of its loads' starts.
LMCACHE_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class RangeSupport:
    """A leaf's part in stitched loads: its ``mode``, the alignment (tokens) a segment of
    it must start on (``None``: the block size), whether its segment can be cut shorter
    than its hit, and why (shown by ``kvcompose explain``). ``loads_inline``: its async
    loads are read inside its worker's ``start_load_kv``, one after the other like sync
    ones, so ``policy: fastest`` prices them one after the other, not in parallel."""

    mode: RangeMode
    align: int | None
    can_cut: bool
    why: str
    loads_inline: bool = False


_KNOWN: dict[str, RangeSupport] = {
    "PrefixStoreConnector": RangeSupport(
        "native",
        None,
        True,
        "looked up at a, loads exactly [a, a + n) by absolute block position",
        # on several KV cache groups its loads are async (a failure goes up by request),
        # but its worker still reads them in start_load_kv (``PrefixStoreWorker``)
        loads_inline=True,
    ),
    "OffloadingConnector": RangeSupport(
        "native",
        None,
        False,
        "searches from chunk a // chunk and loads by absolute position (async); "
        "a cut below its hit trips its partial-tail assert",
    ),
    "MooncakeStoreConnector": RangeSupport(
        "native",
        None,
        False,
        "looked up at a, loads its hit after a by absolute block position; asserts it is "
        "told exactly what it offered, so it cannot be cut",
    ),
    "LMCacheMPConnector": RangeSupport(
        "native",
        None,
        False,
        "looked up at a, offers what it holds from token 0 past a; told any n > 0 it loads "
        "[a, its hit end) by absolute block position (async), so it cannot be cut",
    ),
    "NixlConnector": RangeSupport(
        "last_segment",
        None,
        False,
        "pulls every unhashed block of what it is handed: given a view from a, exactly "
        "[a, end); cannot be cut, so only as the last segment",
    ),
    "LMCacheConnectorV1": RangeSupport(
        "natural_end",
        LMCACHE_CHUNK_TOKENS,
        False,
        "loads [a, its own end) only, sync, with a on its chunk size; no async segment may join",
    ),
    "ExampleConnector": RangeSupport(
        "sole_owner",
        None,
        False,
        "loads every stored token of the prompt whatever it is told",
    ),
}

_UNKNOWN = RangeSupport(
    "sole_owner", None, False, "unknown connector: only loads when it is the one segment"
)
_COMPOSITE = RangeSupport(
    "sole_owner", None, False, "a nested composite takes part as one owner of its whole load"
)


def known_range_support(connector: str | None) -> RangeSupport:
    """The table's entry for a connector class name (``None``: a nested composite)."""
    if connector is None:
        return _COMPOSITE
    return _KNOWN.get(connector, _UNKNOWN)


def range_support(
    connector: str | None,
    mode: RangeMode | None = None,
    align: int | None = None,
) -> RangeSupport:
    """A leaf's range support: the table's entry with the leaf's overrides applied."""
    known = known_range_support(connector)
    if mode is None and align is None:
        return known
    if mode is None or mode == known.mode:
        why = known.why
        mode = known.mode
        can_cut = known.can_cut
    else:
        why = f"set in the tree (the table says {known.mode})"
        can_cut = mode == "native"
    if align is not None:
        why += f"; starts aligned to {align} tokens (set in the tree)"
    return RangeSupport(
        mode, align if align is not None else known.align, can_cut, why, known.loads_inline
    )
