"""The proxy's settings: backends, retry policy, timeouts (a YAML file or CLI flags).

prefill: [http://p1:8100, http://p2:8100]
decode: [http://d1:8200]
max_attempts: 4          # per client request, the first attempt included
backoff_s: 0.05          # doubled after each failed attempt, capped at backoff_max_s
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcompose.config.errors import ConfigError, ErrorItem, located
from kvcompose.config.files import read_file
from kvcompose.tree.error_messages import Wording


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
        out = [base_url(url) for url in urls]
        if len(set(out)) != len(out):
            raise ValueError(f"a backend is listed twice: {out}")
        return out

    def backoff(self, failed_attempts: int) -> float:
        """Seconds to wait before the attempt that follows ``failed_attempts`` failures."""
        if failed_attempts <= 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (failed_attempts - 1))


def base_url(url: str) -> str:
    """A backend's base URL: ``host:port`` gains ``http://``, a trailing ``/`` goes; anything
    that is not an http(s) URL with a host and a valid port is refused here, not at the first
    request."""
    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    text = text.rstrip("/")
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: the scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a base URL has no query or fragment")
    return text


def load_proxy_config(path: str | Path | None = None, **overrides: Any) -> ProxyConfig:
    """The YAML file at ``path`` (if any) with ``overrides`` (CLI flags; ``None`` = unset).

    The file is read like a kvcompose config (``kvcompose.config.files``: size-bounded,
    UTF-8, duplicate keys refused, lines kept); every problem is a ``ConfigError`` whose
    message is one line naming the file, the line and the key."""
    data: dict[str, Any] = {}
    label, linemap = None, None
    if path is not None:
        source = read_file(path)
        label, linemap = source.label, source.linemap
        data.update(source.mapping())
    flags = {k: v for k, v in overrides.items() if v is not None}
    data.update(flags)
    try:
        return ProxyConfig.model_validate(data)
    except ValidationError as exc:
        items = []
        for loc, message in Wording(ProxyConfig).problems(exc):
            if loc and loc[0] in flags:  # a flag's value: no line of the file
                flag = f"--{str(loc[0]).replace('_', '-')}"
                items.append(ErrorItem(loc[1:], f"{flag}: {message}"))
            else:
                items.append(located(linemap, loc, message))
        raise ConfigError(items, label) from None
