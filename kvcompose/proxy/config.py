"""The proxy's settings: backends, retry policy, timeouts (a YAML file or CLI flags).

prefill: [http://p1:8100, http://p2:8100]
decode: [http://d1:8200]
max_attempts: 4          # per client request, the first attempt included
backoff_s: 0.05          # doubled after each failed attempt, capped at backoff_max_s
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Timeouts(BaseModel):
    """Seconds. ``read`` bounds the wait for the next byte of a backend's answer (P's whole
    prefill, or D's next streamed token), not the whole request."""

    model_config = ConfigDict(extra="forbid")

    connect: float = Field(3.0, gt=0)
    read: float = Field(300.0, gt=0)
    health: float = Field(2.0, gt=0)


class ProxyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill: list[str] = Field(min_length=1, description="prefill engines' base URLs")
    decode: list[str] = Field(min_length=1, description="decode engines' base URLs")
    model: str | None = Field(
        None, description="model name served; default: what the backends' /v1/models list"
    )
    max_attempts: int = Field(4, ge=1, description="attempts per request, the first included")
    backoff_s: float = Field(0.05, ge=0, description="wait before the second attempt")
    backoff_max_s: float = Field(1.0, ge=0)
    health_interval_s: float = Field(2.0, gt=0, description="seconds between health checks")
    health_timeouts_out: int = Field(
        3,
        ge=1,
        description="health checks timed out in a row that take a backend out of rotation "
        "(a refused or failed check takes it out at once)",
    )
    timeouts: Timeouts = Field(default_factory=Timeouts)
    release_stale_handoffs: bool = Field(
        True,
        description="when a hand-off P prepared is not decoded (D unreachable, client gone), "
        "ask a healthy decode engine to reject it, which makes its NIXL tell P to free "
        "the blocks at once instead of at the end of P's kv_lease_duration",
    )

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        out = []
        for url in urls:
            url = url.strip().rstrip("/")
            if not url.startswith(("http://", "https://")):
                url = f"http://{url}"
            out.append(url)
        if len(set(out)) != len(out):
            raise ValueError(f"a backend is listed twice: {out}")
        return out

    def backoff(self, failed_attempts: int) -> float:
        """Seconds to wait before the attempt that follows ``failed_attempts`` failures."""
        if failed_attempts <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (failed_attempts - 1))


def load_proxy_config(path: str | Path | None = None, **overrides: Any) -> ProxyConfig:
    """The YAML file at ``path`` (if any) with ``overrides`` (CLI flags; ``None`` = unset)."""
    data: dict[str, Any] = {}
    if path is not None:
        import yaml

        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        data.update(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return ProxyConfig.model_validate(data)
