"""The CLI's check of kvcompose's own store leaves: their ``extra_config`` as the store reads it.

The config layer cannot import the stores (they are siblings below the CLI), and a store's
keys are the store's business; but ``validate`` accepting ``chunk_blocks: 0`` that the engine
then refuses at start would be a wrong acceptance. So every CLI verb that loads a config runs
each ``PrefixStoreConnector`` leaf's ``extra_config`` through the store's own model, and a
problem becomes a located config error.
"""

from __future__ import annotations

from kvcompose.config import Config
from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.tree import Leaf, walk

#: Store connectors whose ``extra_config`` is exactly ``PrefixStoreConfig`` (the test-only
#: ``FaultyPrefixStoreConnector`` adds keys of its own).
CHECKED = "PrefixStoreConnector"


def check_stores(config: Config) -> None:
    """Raise the first store leaf's config error (file and line when known)."""
    paths = config.leaf_paths()
    for _, node in walk(config.tree):
        if not isinstance(node, Leaf) or node.connector != CHECKED:
            continue
        if not (node.module_path or "").startswith("kvcompose"):
            continue
        try:
            PrefixStoreConfig.from_extra_config(dict(node.extra_config or {}))
        except ValueError as exc:
            where = paths.get(node.name or "", ())
            raise config.error((*where, "extra_config"), str(exc)) from None
