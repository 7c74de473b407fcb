"""``kvcompose proxy``: a prefill/decode router that finishes every request, token-exact.

``create_app(config)`` is the ASGI app; ``ProxyConfig`` its settings; ``Router`` the core
(attempt loop, backend choice, hand-off release) the HTTP front drives. docs/proxy.md.
"""

from kvcompose.proxy.app import create_app
from kvcompose.proxy.config import ProxyConfig, load_proxy_config
from kvcompose.proxy.core import GenerationFailed, GenerationRequest, Router

__all__ = [
    "GenerationFailed",
    "GenerationRequest",
    "ProxyConfig",
    "Router",
    "create_app",
    "load_proxy_config",
]
