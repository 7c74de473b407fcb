"""Reading a running engine's insides from Python: its core, scheduler and connector trees.

vLLM's ``LLM`` keeps its ``EngineCore`` behind a client; only the in-process client
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) holds the core itself, as ``engine_core``. Everything
here reaches the core through ``engine_core`` so that this one place knows that path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def engine_core(llm: Any) -> Any:
    """The ``EngineCore`` of an in-process ``vllm.LLM`` (or ``LLMEngine``)."""
    engine = getattr(llm, "llm_engine", llm)
    core = getattr(engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
    if core is None:
        raise RuntimeError(
            "the engine core runs in another process; set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 to inspect it from Python"
        )
    return core


def scheduler(llm: Any) -> Any:
    """The v1 ``Scheduler`` of an in-process engine."""
    return engine_core(llm).scheduler


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine (``None`` without one)."""
    return scheduler(llm).connector


def worker_connector() -> Any:
    """The worker-side connector of this process (single-process engines; ``None`` without
    one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def kv_cache_facts(llm: Any) -> dict[str, Any]:
    """What vLLM set up for the KV cache, read from the running engine: ``num_blocks`` (the
    block pool's blocks), ``groups`` (each KV cache group's spec class, in vLLM's order) and
    ``hma`` (whether the hybrid KV cache manager stayed on: vLLM turns it off for a
    connector that does not support it, and then sizes every layer as full attention, one
    group; ``VllmConfig``'s hybrid KV cache manager check sets
    ``scheduler_config.disable_hybrid_kv_cache_manager``)."""
    core = engine_core(llm)
    config = core.scheduler.kv_cache_config
    disabled = getattr(core.vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", None)
    return {
        "num_blocks": int(config.num_blocks),
        "groups": [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups],
        "hma": not disabled,
    }


@dataclass(frozen=True)
class TreeNode:
    """One connector of a connector tree: its ``/``-joined path from the root (``"root"`` for
    the root), its own name, its parent's path and its index among its siblings."""

    path: str
    name: str
    parent: str | None
    index: int
    connector: Any


def default_child_name(index: int, connector: Any) -> str:
    """The name of a child that has none of its own (a vLLM ``MultiConnector`` child)."""
    return f"{index}.{type(connector).__name__}"


def walk_connectors(
    root: Any,
    *,
    root_name: str = "root",
    child_name: Callable[[int, Any], str] = default_child_name,
) -> Iterator[TreeNode]:
    """A connector and its descendants, depth first. Composite connectors (kvcompose nodes and
    vLLM's ``MultiConnector``) list their children in ``_connectors``; a kvcompose node also
    names them (``children[i].name``), others get ``child_name(index, connector)``."""
    if root is None:
        return
    yield from _walk(root, root_name, None, 0, child_name, top=True)


def _walk(
    conn: Any,
    name: str,
    parent: str | None,
    index: int,
    child_name: Callable[[int, Any], str],
    *,
    top: bool = False,
) -> Iterator[TreeNode]:
    path = "root" if top else (name if parent == "root" else f"{parent}/{name}")
    yield TreeNode(path=path, name=name, parent=parent, index=index, connector=conn)
    subs = getattr(conn, "_connectors", None)
    if not isinstance(subs, list):
        return
    named = getattr(conn, "children", None)
    for i, sub in enumerate(subs):
        if named is not None and i < len(named) and hasattr(named[i], "name"):
            sub_name = named[i].name
        else:
            sub_name = child_name(i, sub)
        yield from _walk(sub, sub_name, path, i, child_name)
