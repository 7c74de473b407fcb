"""The ``vllm.general_plugins`` entry point: registers kvcompose's connectors by name.

With it, ``{"kv_connector": "KVCompose", "kv_role": ...}`` works without
``kv_connector_module_path``. vLLM calls general plugins once per process (and may call them
again); registering twice is harmless here. Nothing heavy is imported: vLLM's factory
registers a lazy loader, and ``kvcompose.connector`` is imported only when the connector is
built.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: (name vLLM looks up, module, class)
CONNECTORS: tuple[tuple[str, str, str], ...] = (
    ("KVCompose", "kvcompose.connector", "KVCompose"),
    ("KVComposeHMA", "kvcompose.connector", "KVComposeHMA"),
)


def register() -> None:
    """Register ``KVCompose`` and ``KVComposeHMA`` with vLLM's ``KVConnectorFactory``.

    Idempotent; skips a name another package already registered (with a warning) and does
    nothing when vLLM is not installed.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    registry = KVConnectorFactory._registry
    for name, module, cls in CONNECTORS:
        if name in registry:
            if getattr(registry[name], "_kvcompose", False) is False:
                logger.warning(
                    "kvcompose: connector name %r is already registered by "
                    "another package; not overriding it",
                    name,
                )
            continue
        try:
            KVConnectorFactory.register_connector(name, module, cls)
        except ValueError:  # registered concurrently
            continue
        registry[name]._kvcompose = True  # type: ignore[attr-defined]
