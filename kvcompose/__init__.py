"""kvcompose: compose vLLM KV-cache connectors declaratively.

``import kvcompose`` is cheap and does not import vLLM: the connector classes are resolved
lazily, so the config tools and the CLI work without vLLM, and vLLM's factory still finds
``kvcompose.KVCompose`` through ``getattr`` when it loads ``kv_connector_module_path="kvcompose"``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KVCompose": "kvcompose.connector",
    "KVComposeHMA": "kvcompose.connector",
}

__all__ = ["KVCompose", "KVComposeHMA", "__version__"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvcompose' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
