"""Where the document of a ``kv_connector_extra_config`` comes from.

vLLM hands a composite one mapping; the tree in it can be inline (the tree's keys at the top),
in a file (``config``, or the ``KVCOMPOSE_CONFIG_FILE`` environment variable), and any other keys
next to it are overrides. Kept apart from the loading pipeline because these are the rules of
the extra config's shape, not of the tree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvcompose.config.env import ENV_CONFIG_FILE, Override, mapping_overrides
from kvcompose.config.errors import Path, shown_list
from kvcompose.config.files import Source
from kvcompose.config.include import Referrer, including
from kvcompose.tree import NODE_KINDS, describe
from kvcompose.tree.error_messages import format_path

EXTRA_CONFIG = "kv_connector_extra_config"


@dataclass
class Found:
    """Where an extra config's document is: inline, or in a file named at ``referrer``;
    and the override keys given next to it."""

    overrides: list[Override]
    inline: Source | None = None
    file: str | None = None
    referrer: Referrer | None = None


@contextlib.contextmanager
def opened(found: Found) -> Iterator[Source]:
    if found.inline is not None:
        yield found.inline
    else:
        assert found.file is not None
        with including(found.file, found.referrer) as src:
            yield src


def split_extra(
    extra: dict[str, Any], env: Mapping[str, str], outer: Source, prefix: Path
) -> Found:
    """Where the document of an extra config comes from, and the override keys given next
    to it."""
    here = Source(extra, outer.label or EXTRA_CONFIG, outer.linemap, outer.path)
    late: list[Override] = []
    if "set" in extra:
        late = mapping_overrides(extra.pop("set"), dotted(prefix, "set"))
    has_tree = "connectors" in extra or "tree" in extra or any(k in extra for k in NODE_KINDS)
    if has_tree and "config" not in extra:
        return Found(late, inline=here)
    top = [
        Override(dotted(prefix, key), key, value) for key, value in extra.items() if key != "config"
    ]
    if "config" in extra:
        path = extra["config"]
        # a path object was made text before the walk (config_from_extra_config)
        if not isinstance(path, str) or not path:
            got = "an empty string" if path == "" else describe(path)
            raise here.error((*prefix, "config"), f"expected a file path, got {got}")
        return Found(
            top + late,
            file=path,
            referrer=Referrer(here.label, (*prefix, "config"), outer.linemap),
        )
    if env.get(ENV_CONFIG_FILE):
        return Found(top + late, file=env[ENV_CONFIG_FILE], referrer=Referrer(ENV_CONFIG_FILE))
    got = shown_list(repr(k) for k in extra) or "none"
    needs = "a nested KVCompose connector needs its own tree: " if prefix else ""
    raise here.error(
        prefix,
        f"{needs}no tree given: expected 'tree' (an inline tree), 'config' (a file path) or "
        f"'connectors' (MultiConnector form), or set {ENV_CONFIG_FILE}; got keys: {got}",
    )


def dotted(prefix: Path, key: str) -> str:
    return format_path((*prefix, key)) if prefix else f"{EXTRA_CONFIG}.{key}"
