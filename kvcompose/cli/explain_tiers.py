"""The tier lines ``kvcompose explain`` prints under a kvcompose store leaf: its medium,
capacity, how it saves, its admission rule, its promotion target, and an emulated read
cost when it has one.

Read through the store's own model (``PrefixStoreConfig``: its defaults, no vLLM import, so
``explain`` runs without vLLM), as the store reads its ``extra_config`` when it starts.
"""

from __future__ import annotations

from kvcompose.config.limits import size_text
from kvcompose.stores.prefix.admission import AdmissionRule
from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.tree import Leaf, Node, leaves

STORE_CONNECTORS = {"PrefixStoreConnector", "FaultyPrefixStoreConnector"}


def is_store(leaf: Leaf) -> bool:
    return leaf.connector in STORE_CONNECTORS and (leaf.module_path or "").startswith("kvcompose")


def settings(leaf: Leaf) -> PrefixStoreConfig:
    """The store's settings, defaults filled in by its model (keys a test double adds are
    left out; ``validate`` has already refused a bad value)."""
    known = PrefixStoreConfig.model_fields
    extra = {k: v for k, v in (leaf.extra_config or {}).items() if k in known}
    return PrefixStoreConfig.from_extra_config(extra)


def _promotes(leaf: Leaf) -> bool:
    try:
        return settings(leaf).promote
    except ValueError:  # the leaf's own lines say why
        return False


def capacity_text(config: PrefixStoreConfig) -> str:
    parts = []
    if config.max_chunks is not None:
        parts.append(f"{config.max_chunks} chunks")
    if config.max_bytes is not None:
        parts.append(size_text(config.max_bytes))
    if not parts:
        return "capacity: unbounded"
    return "capacity: " + " and ".join(parts) + " (evicts least recently used; first chunks last)"


def admission_text(config: PrefixStoreConfig) -> str:
    if config.read_only:
        return "admission: read-only (saves nothing)"
    # the store's own rule, in its words; promotion has a line of its own
    rule = AdmissionRule(
        config.admit_min_prompt_tokens, config.admit_min_seen, False, config.admit_when
    )
    how = (
        f"written by a background writer (queue {config.max_pending_saves} chunks, drops when full)"
        if config.save_mode == "background"
        else "written in the engine step"
    )
    return f"admission: {rule.describe()}; {how}"


def medium_text(config: PrefixStoreConfig) -> str:
    if config.medium:
        return f"medium: {config.medium}"
    return "medium: from the mount at start (tmpfs -> host, else disk)"


def emulation_text(config: PrefixStoreConfig) -> str | None:
    """``emulate_read``, said to be emulation (a benchmark setting, not the medium's speed)."""
    emulate = config.emulate_read
    if emulate is None:
        return None
    parts = [f"{emulate.latency_ms:g} ms"]
    if emulate.gbps:
        parts.append(f"bytes / {emulate.gbps:g} GB/s")
    return (
        "EMULATED slow reads: every load takes at least " + " + ".join(parts) + " (sleeps after "
        "the real read; for benchmarks)"
    )


def promotion_lines(tree: Node) -> dict[str, str]:
    """Leaf name -> its promotion line, for store leaves of a chain with ``promote: true``."""
    out: dict[str, str] = {}

    def visit(node: Node) -> None:
        children = getattr(node, "children", None)
        if not children:
            return
        stores = [c for c in children if isinstance(c, Leaf) and is_store(c)]
        promoted = [c for c in stores if _promotes(c)]
        for leaf in promoted:
            others = [c.name for c in children if c is not leaf]
            out[leaf.name] = (
                "promotion: saves what " + ", ".join(others) + " load, past its admission rule"
            )
        for leaf in stores:
            if leaf in promoted:
                continue
            targets = [p.name for p in promoted]
            if targets:
                out[leaf.name] = "its loads are promoted into: " + ", ".join(targets)
        for child in children:
            visit(child)

    visit(tree)
    return out


def tier_lines(tree: Node, leaf: Leaf) -> list[str]:
    """The lines under ``leaf`` (none for leaves that are not kvcompose stores)."""
    if not is_store(leaf):
        return []
    try:
        config = settings(leaf)
    except ValueError as exc:  # a store ``validate`` does not check (a test double's)
        return [str(exc)]
    lines = [medium_text(config) + "; " + capacity_text(config), admission_text(config)]
    promo = promotion_lines(tree).get(leaf.name or "")
    if promo:
        lines.append(promo)
    emulated = emulation_text(config)
    if emulated:
        lines.append(emulated)
    return lines


def hybrid_line(tree: Node) -> str | None:
    """What the tree's stores do under vLLM's hybrid KV cache manager (see
    ``kvcompose.stores.prefix.groups``), or None without a store."""
    names = [leaf.name for leaf in leaves(tree) if is_store(leaf)]
    if not names:
        return None
    return (
        f"HMA and the stores ({', '.join(names)}): each KV cache group saved by its own "
        "blocks, a sliding group's window loaded; loads are async under several groups "
        "(a failed load is reported by request)"
    )
