"""KV stores usable as (child) vLLM KV connectors."""

from kvcompose.stores.prefix_store import (
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
