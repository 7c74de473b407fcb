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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvcompose.tree import Chain, Leaf, Node, walk
from kvcompose.tree.messages import shown


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

KNOWN: dict[str, KnownConnector] = {"LMCacheConnectorV1": LMCACHE}

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
    package = needs_package(leaf)
    if package:
        lines.append(
            f"{facts.family}: needs the {package!r} package where vLLM runs "
            f"(or extra_config {facts.package_unless}: true for vLLM's vendored adapter)"
        )
    return lines


def tree_warnings(tree: Node) -> Iterator[str]:
    """Orders of children that make a known connector do the wrong thing."""
    for _, node in walk(tree):
        if not isinstance(node, Chain) or node.policy != "first":
            continue
        seen_lmcache: list[str] = []
        for child in node.children:
            if not isinstance(child, Leaf) or child.module_path is not None:
                continue
            if child.connector in KNOWN:
                seen_lmcache.append(child.name)
            elif child.connector in REMOTE_PREFILL and seen_lmcache:
                yield (
                    f"chain {node.name!r} asks {', '.join(map(repr, seen_lmcache))} "
                    f"(LMCache) before {child.name!r} ({child.connector}) with policy "
                    "first: on a decode engine a short LMCache hit wins over the remote "
                    f"prefill, {child.name!r} is told 0 and the rest is recomputed; put "
                    f"{child.name!r} first or use policy longest"
                )


__all__ = ["KNOWN", "LMCACHE", "KnownConnector", "describe", "known", "needs_package", "no_hma"]
