"""The tier lines ``kvcompose explain`` prints under a kvcompose store leaf: its medium,
capacity, how it saves, its admission rule, its promotion target, and an emulated read
cost when it has one.

Read from the leaf's ``extra_config`` as written (no vLLM import: ``explain`` and
``validate`` run without vLLM); the store validates the same keys when it starts.
"""

from __future__ import annotations

from typing import Any

from kvcompose.tree import Leaf, Node
from kvcompose.tree.conditions import RequestCondition, describe_condition

STORE_CONNECTORS = {"PrefixStoreConnector", "FaultyPrefixStoreConnector"}


def is_store(leaf: Leaf) -> bool:
    return leaf.connector in STORE_CONNECTORS and (leaf.module_path or "").startswith("kvcompose")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def capacity_text(extra: dict[str, Any]) -> str:
    parts = []
    if extra.get("max_chunks") is not None:
        parts.append(f"{extra['max_chunks']} chunks")
    if extra.get("max_bytes") is not None:
        parts.append(_size(int(extra["max_bytes"])))
    if not parts:
        return "capacity: unbounded"
    return "capacity: " + " and ".join(parts) + " (evicts least recently used; first chunks last)"


def admission_text(extra: dict[str, Any]) -> str:
    if extra.get("read_only"):
        return "admission: read-only (saves nothing)"
    parts = []
    if int(extra.get("admit_min_prompt_tokens", 0) or 0) > 0:
        parts.append(f"prompts >= {extra['admit_min_prompt_tokens']} tokens")
    if int(extra.get("admit_min_seen", 1) or 1) > 1:
        parts.append(f"chunks seen >= {extra['admit_min_seen']} times")
    when = extra.get("admit_when")
    if isinstance(when, dict):
        try:
            parts.append(f"requests where {describe_condition(RequestCondition(**when))}")
        except (ValueError, TypeError):  # validate reports it; explain shows it as written
            parts.append(f"requests where {when!r} (invalid)")
    mode = extra.get("save_mode", "sync")
    how = (
        f"written by a background writer (queue {extra.get('max_pending_saves', 64)} chunks, "
        "drops when full)"
        if mode == "background"
        else "written in the engine step"
    )
    return "admission: " + (" and ".join(parts) if parts else "every save") + f"; {how}"


def medium_text(extra: dict[str, Any]) -> str:
    medium = extra.get("medium")
    if medium:
        return f"medium: {medium}"
    return "medium: from the mount at start (tmpfs -> host, else disk)"


def emulation_text(extra: dict[str, Any]) -> str | None:
    """``emulate_read``, said to be emulation (a benchmark setting, not the medium's speed)."""
    emulate = extra.get("emulate_read")
    if not isinstance(emulate, dict):
        return None
    parts = [f"{emulate.get('latency_ms', 0)} ms"]
    if emulate.get("gbps"):
        parts.append(f"bytes / {emulate['gbps']} GB/s")
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
        promoted = [c for c in stores if (c.extra_config or {}).get("promote")]
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
    extra = dict(leaf.extra_config or {})
    lines = [
        medium_text(extra) + "; " + capacity_text(extra),
        admission_text(extra),
    ]
    promo = promotion_lines(tree).get(leaf.name or "")
    if promo:
        lines.append(promo)
    emulated = emulation_text(extra)
    if emulated:
        lines.append(emulated)
    return lines
