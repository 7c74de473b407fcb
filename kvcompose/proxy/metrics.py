"""Prometheus metrics of the proxy (``/metrics``), in a registry of their own per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcompose.proxy.backends import Backend

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvcompose_proxy_requests", "client requests by endpoint and "
                                "outcome", ["endpoint", "outcome"], registry=r)  # fmt: skip
        self.retries = Counter("kvcompose_proxy_retries", "attempts that failed and were "
                               "retried, by cause", ["cause"], registry=r)  # fmt: skip
        self.attempts = Histogram("kvcompose_proxy_attempts_per_request", "prefill/decode "
                                  "attempts per request", buckets=(1, 2, 3, 4, 6, 8, 12),
                                  registry=r)  # fmt: skip
        self.backend_seconds = Histogram(
            "kvcompose_proxy_backend_seconds",
            "time in one backend call (prefill: P's answer; decode: D's stream)",
            ["role"],
            buckets=_LATENCY,
            registry=r,
        )
        self.request_seconds = Histogram("kvcompose_proxy_request_seconds", "time from a "
                                         "request's first attempt to its end",
                                         buckets=_LATENCY, registry=r)  # fmt: skip
        self.in_flight = Gauge("kvcompose_proxy_in_flight", "client requests being served",
                               registry=r)  # fmt: skip
        self.healthy = Gauge("kvcompose_proxy_backend_healthy", "1 when the backend is in "
                             "rotation", ["role", "url"], registry=r)  # fmt: skip
        self.releases = Counter("kvcompose_proxy_handoff_releases", "hand-offs released "
                                "through a decode engine so P frees its blocks", ["outcome"],
                                registry=r)  # fmt: skip

    def backend_changed(self, backend: Backend) -> None:
        self.healthy.labels(role=backend.role, url=backend.url).set(1 if backend.healthy else 0)
