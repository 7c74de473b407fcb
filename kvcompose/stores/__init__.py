"""KV stores usable as (child) vLLM KV connectors.

Configs name ``PrefixStoreConnector`` with ``module_path: kvcompose.stores``.
"""

from kvcompose.stores.prefix import (
    PrefixStoreConfig,
    PrefixStoreConnector,
    PrefixStoreStats,
    chunk_keys,
    store_usage,
)

__all__ = [
    "PrefixStoreConfig",
    "PrefixStoreConnector",
    "PrefixStoreStats",
    "chunk_keys",
    "store_usage",
]
