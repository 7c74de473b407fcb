"""The store's ``kv_connector_extra_config``, as a frozen pydantic model.

vLLM hands a connector its extra config as a plain dict (from JSON or YAML), so a typo or
a wrong type would otherwise surface much later, inside the engine. :meth:`from_extra_config`
validates it once at construction and turns pydantic's error list into one line that names
the offending key, because that line is what a user sees in an engine's startup failure.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcompose.tree.conditions import RequestCondition


class EmulateRead(BaseModel):
    """An emulated slow tier: every load takes at least ``latency_ms`` plus its bytes at
    ``gbps`` (GB/s, 10^9 bytes), by sleeping after the real read for what is left.

    For benchmarks that need a tier slower than this machine's page cache (a network
    store, a real disk); the data still comes from the store's files.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    latency_ms: Annotated[float, Field(ge=0, description="Fixed cost of each load (ms).")] = 0.0
    gbps: (
        Annotated[float, Field(gt=0, description="Bandwidth of a load (GB/s); none: unlimited.")]
        | None
    ) = None

    def min_seconds(self, nbytes: int) -> float:
        """The shortest a load of ``nbytes`` may take."""
        transfer = nbytes / (self.gbps * 1e9) if self.gbps else 0.0
        return self.latency_ms / 1e3 + transfer


class PrefixStoreConfig(BaseModel):
    """The parsed ``kv_connector_extra_config`` (see :mod:`kvcompose.stores.prefix`)."""

    # strict: YAML/JSON values are taken as they are (``"yes"`` is not a bool, ``2.0`` not
    # an int), as the connector accepted them before it used pydantic.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: The connector named in error messages (a subclass under another name sets its own).
    CONNECTOR: ClassVar[str] = "PrefixStoreConnector"
    #: What each key must be, for the one-line error about it.
    RULES: ClassVar[dict[str, str]] = {
        "load_mode": "must be 'sync' or 'async'",
        "chunk_blocks": "must be an int >= 1",
        "max_chunks": "must be an int >= 1",
        "read_only": "must be a bool",
        "namespace": "must be a string",
        "save_mode": "must be 'sync' or 'background'",
        "max_pending_saves": "must be an int >= 1",
        "max_bytes": "must be an int >= 1",
        "medium": "must be one of 'cpu', 'tmpfs', 'disk', 'remote'",
        "admit_min_prompt_tokens": "must be an int >= 0",
        "admit_min_seen": "must be an int >= 1",
        "promote": "must be a bool",
        "admit_when": (
            "must be a mapping of request conditions (param/equals, min_prompt_tokens, "
            "max_prompt_tokens, predicate), as a route rule's"
        ),
        "emulate_read": "must be a mapping {latency_ms: number >= 0, gbps: number > 0}",
    }
    #: Keys this class no longer accepts, with where they went.
    MOVED: ClassVar[dict[str, str]] = {
        "fail_load_request_ids": (
            "fault injection is test-only: use connector FaultyPrefixStoreConnector "
            "(module_path kvcompose.testing.faulty_store)"
        ),
    }

    path: Annotated[str, Field(min_length=1, description="Directory of the store.")]
    load_mode: Literal["sync", "async"] = Field(
        "sync", description="Load before the step's forward (sync) or across steps (async)."
    )
    chunk_blocks: Annotated[int, Field(ge=1, description="Chunk size in vLLM blocks.")] = 1
    max_chunks: Annotated[int, Field(ge=1, description="Cap on chunk files (LRU).")] | None = None
    read_only: bool = Field(False, description="Only load; never save, touch or evict.")
    namespace: str | None = Field(None, description="Replaces the model part of the salt.")
    save_mode: Literal["sync", "background"] = Field(
        "sync",
        description="Write saves in the step (sync) or on a writer thread (background), "
        "holding the request's blocks until written.",
    )
    max_pending_saves: Annotated[
        int, Field(ge=1, description="Chunks queued for the writer; more are dropped.")
    ] = 64
    max_bytes: (
        Annotated[int, Field(ge=1, description="Cap on the bytes of chunk files.")] | None
    ) = None
    medium: Literal["cpu", "tmpfs", "disk", "remote"] | None = Field(
        None, description="What holds the files (hit source, KV events); default: from the mount."
    )
    admit_min_prompt_tokens: Annotated[
        int, Field(ge=0, description="Save only prompts of at least this many tokens.")
    ] = 0
    admit_min_seen: Annotated[
        int, Field(ge=1, description="Save a chunk once requests have shown it this many times.")
    ] = 1
    admit_when: RequestCondition | None = Field(
        None,
        description="Save only requests that meet these conditions (a route rule's: "
        "`param`/`equals`, prompt-length bounds, `predicate`).",
    )
    promote: bool = Field(
        False, description="Store chunks another tier loaded, whatever the admission rule."
    )
    emulate_read: EmulateRead | None = Field(
        None,
        description="Benchmarks only: make every load take at least latency_ms + bytes/gbps "
        "(an emulated slow tier; sleeps after the real read).",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _path_like(cls, value: Any) -> Any:
        """Accept ``pathlib.Path`` and other path objects as well as strings."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PrefixStoreConfig:
        """Validate ``extra``; raises ``ValueError`` with one line naming the bad key."""
        extra = dict(extra or {})
        known = list(cls.model_fields)
        moved = sorted(k for k in extra if k in cls.MOVED and k not in known)
        if moved:
            raise ValueError(
                f"{cls.CONNECTOR}: {moved[0]} is no longer accepted; {cls.MOVED[moved[0]]}"
            )
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"{cls.CONNECTOR}: unknown kv_connector_extra_config keys {unknown}; "
                f"known keys: {known}"
            )
        try:
            return cls(**extra)
        except ValidationError as exc:
            raise ValueError(cls._one_line(exc, extra)) from None

    @classmethod
    def _one_line(cls, exc: ValidationError, extra: dict[str, Any]) -> str:
        """The first error in field order, phrased as the key's rule."""
        order = list(cls.model_fields)
        errors = sorted(
            exc.errors(),
            key=lambda e: order.index(str(e["loc"][0])) if e["loc"] else len(order),
        )
        key = str(errors[0]["loc"][0]) if errors[0]["loc"] else ""
        if key == "path":
            return f"{cls.CONNECTOR}: kv_connector_extra_config.path is required"
        rule = cls.RULES.get(key)
        if key == "admit_when" and isinstance(extra.get(key), dict):
            inner = ".".join(str(part) for part in errors[0]["loc"][1:])
            where = f"admit_when.{inner}" if inner else "admit_when"
            return f"{cls.CONNECTOR}: {where}: {errors[0]['msg']}"
        if rule is None:
            return f"{cls.CONNECTOR}: {key}: {errors[0]['msg']}"
        return f"{cls.CONNECTOR}: {key} {rule}, got {extra.get(key)!r}"
