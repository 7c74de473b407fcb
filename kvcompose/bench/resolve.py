"""Contenders made ready to run: each placeholder gets a fresh directory, a kvcompose config
is checked by the document's rules (the checks against vLLM run where the engine loads it:
the bench's own process never imports vLLM) and turned into the ``kv_transfer_config`` the
engine is given, and the leaves that store into a placeholder are found (the preparation
engine fills those stores).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvcompose.bench.contenders import (
    PLACEHOLDER,
    ContenderDef,
    ContenderError,
    ResolvedContender,
    StoreLeaf,
)


def store_dirs(
    contender: ContenderDef, disk_root: str | os.PathLike[str], tmpfs_root: str | os.PathLike[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Directories of a contender's stores: ``<root>/<label>/<NAME>``."""
    dirs: dict[str, str] = {}
    kinds: dict[str, str] = {}
    for name, where in contender.store_refs().items():
        root = tmpfs_root if where == "tmpfs" else disk_root
        dirs[name] = os.path.join(os.fspath(root), contender.label, name)
        kinds[name] = where
    return dirs, kinds


def _with_hma_facts(config: Any) -> Any:
    """``config`` with vLLM's facts about its leaves when its ``hma`` is auto and vLLM is
    installed; unchanged where they cannot be read (the engine then reports why)."""
    import dataclasses

    from kvcompose.config import ConfigError, vllm_available

    if config.hma is not None or not vllm_available():
        return config
    from kvcompose.config.vllm_checks import inspect_config

    try:
        return dataclasses.replace(config, facts=inspect_config(config))
    except ConfigError:
        return config


def resolve(
    contender: ContenderDef,
    run_dir: str | os.PathLike[str],
    *,
    disk_root: str | os.PathLike[str],
    tmpfs_root: str | os.PathLike[str],
) -> ResolvedContender:
    """Fill in the store directories, validate, and build the vLLM config.

    The document's own rules are checked here; the checks against vLLM (connector names,
    modules, ``KVTransferConfig`` fields) run where the engine loads the tree, which reports
    them as the contender's failure. One fact is read from vLLM here, where it is installed:
    under ``hma: auto`` whether every leaf supports vLLM's hybrid KV cache manager, which
    decides the entry vLLM gets (``KVComposeHMA`` or ``KVCompose``, for which vLLM turns HMA
    off: half the blocks on a hybrid model). That imports vLLM once (about 10 s)."""
    if contender.kind == "none":
        return ResolvedContender(contender=contender, kv_transfer_config=None)
    assert contender.text is not None
    dirs, kinds = store_dirs(contender, disk_root, tmpfs_root)

    def sub(match: re.Match[str]) -> str:
        return dirs[match.group(2)]

    text = PLACEHOLDER.sub(sub, contender.text)
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    resolved_file = run / f"contender.{contender.fmt}"
    resolved_file.write_text(text, encoding="utf-8")
    by_path = {path: name for name, path in dirs.items()}
    if contender.kind == "vllm":
        ktc = json.loads(text)
        leaves = _vllm_leaves(ktc)
        connector = str(ktc.get("kv_connector"))
        tree = None
    else:
        from kvcompose import tree as nodes
        from kvcompose.config import ConfigError, load_config
        from kvcompose.config.files import parse_bytes
        from kvcompose.config.render import vllm_args

        try:
            # Read as the user's file (its name in messages, includes beside it); the store
            # placeholders are replaced within their lines, so the lines are the file's.
            source = parse_bytes(
                text.encode(), contender.source, contender.fmt, path=contender.source
            )
            config = load_config(source, env={}, check_vllm=False)
            ktc = vllm_args(_with_hma_facts(config))
        except ConfigError as exc:
            raise ContenderError(f"contender {contender.label!r}: {exc}") from None
        tree = config.tree
        leaves = [
            (leaf.connector, leaf.module_path, dict(leaf.extra_config))
            for leaf in nodes.leaves(config.tree)
        ]
        connector = str(ktc.get("kv_connector"))
    store_leaves = []
    for conn, module, extra in leaves:
        for value in _strings(extra):
            if value in by_path:
                store_leaves.append(
                    StoreLeaf(
                        store=by_path[value],
                        connector=conn,
                        module_path=module,
                        extra_config=extra,
                        extra_config_path_value=value,
                    )
                )
                break
    return ResolvedContender(
        contender=contender,
        kv_transfer_config=ktc,
        stores=dirs,
        store_kinds=kinds,
        store_leaves=store_leaves,
        connector=connector,
        tree=tree,
    )


def _vllm_leaves(ktc: Mapping[str, Any]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """Leaf connectors of a vLLM kv_transfer_config (MultiConnector children, recursively)."""
    extra = ktc.get("kv_connector_extra_config") or {}
    if ktc.get("kv_connector") == "MultiConnector" and isinstance(extra.get("connectors"), list):
        out = []
        for child in extra["connectors"]:
            if isinstance(child, Mapping):
                out.extend(_vllm_leaves(child))
        return out
    return [(str(ktc.get("kv_connector")), ktc.get("kv_connector_module_path"), dict(extra))]


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
