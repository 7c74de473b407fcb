"""KV stores usable as (child) vLLM KV connectors.

Configs name ``PrefixStoreConnector`` with ``module_path: kvcompose.stores``.
"""

from typing import Any

from kvcompose.stores import prefix
from kvcompose.stores.prefix import PrefixStoreConfig


def __getattr__(name: str) -> Any:
    """The rest from ``kvcompose.stores.prefix``, imported on first use (they need vLLM)."""
    if name in __all__:
        value = getattr(prefix, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PrefixStoreConfig",
    "PrefixStoreConnector",
    "PrefixStoreStats",
    "chunk_keys",
    "store_usage",
]
