"""A prefix-aware disk (or tmpfs) KV store, usable as a vLLM v1 KV connector
(``PrefixStoreConnector``): one file per chunk of a prompt, keyed by a chained hash, so a
prompt that extends a stored one finds its shared start.

The manual, with every ``kv_connector_extra_config`` key (generated from the ``Field``s of
:class:`PrefixStoreConfig`), the file format and the limits, is ``docs/stores.md``.
"""

from importlib import import_module
from typing import Any

from kvcompose.stores.prefix.config import PrefixStoreConfig

# Everything else imports vLLM and torch: loaded on first use (PEP 562), so that reading or
# checking a store's config (``kvcompose validate``) stays as quick as the config layer.
_LAZY = {
    "PrefixStoreConnector": "connector",
    "chunk_file_name": "files",
    "store_usage": "files",
    "chunk_keys": "keys",
    "lookup_limit_chunks": "keys",
    "ChunkLoad": "metadata",
    "LoadSpec": "metadata",
    "PrefixStoreMetadata": "metadata",
    "SaveSpec": "metadata",
    "PrefixStoreStats": "stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ChunkLoad",
    "LoadSpec",
    "PrefixStoreConfig",
    "PrefixStoreConnector",
    "PrefixStoreMetadata",
    "PrefixStoreStats",
    "SaveSpec",
    "chunk_file_name",
    "chunk_keys",
    "lookup_limit_chunks",
    "store_usage",
]
