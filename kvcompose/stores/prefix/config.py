"""The store's ``kv_connector_extra_config``, as a frozen pydantic model.

vLLM hands a connector its extra config as a plain dict (from JSON or YAML), so a typo or
a wrong type would otherwise surface much later, inside the engine. :meth:`from_extra_config`
validates it once at construction and turns pydantic's error list into one line that names
the offending key, because that line is what a user sees in an engine's startup failure.
Each key is described once, in its ``Field``: ``docs/stores.md``, ``kvcompose explain`` and
the messages read it from there.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcompose.tree.conditions import RequestCondition
from kvcompose.tree.error_messages import Wording, at


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
    #: Keys this class no longer accepts, with where they went.
    MOVED: ClassVar[dict[str, str]] = {
        "fail_load_request_ids": (
            "fault injection is test-only: use connector FaultyPrefixStoreConnector "
            "(module_path kvcompose.testing.faulty_store)"
        ),
    }

    path: Annotated[
        str,
        Field(
            min_length=1,
            description="Directory of the store, created if missing: one "
            "`<key>.safetensors` file per chunk, holding every attention layer's KV for the "
            "chunk's tokens.",
        ),
    ]
    load_mode: Literal["sync", "async"] = Field(
        "sync",
        description="`sync`: loaded in `start_load_kv` before the forward of the step that "
        "schedules the request. `async`: the request waits in `WAITING_FOR_REMOTE_KVS`; the "
        "worker loads it in `start_load_kv` and reports it in `finished_recving` of the "
        "same step. Under several KV cache groups (vLLM's hybrid KV cache manager) loads "
        "are `async` either way: vLLM takes a failed load only by request there.",
    )
    chunk_blocks: Annotated[int, Field(ge=1, description="Chunk size in vLLM blocks.")] = 1
    max_chunks: int | None = Field(
        None,
        ge=1,
        description="Cap on the chunk files; after each write the least recently written or "
        "loaded go, a chain's first chunks last.",
    )
    read_only: bool = Field(False, description="Only load: never save, touch or evict files.")
    namespace: str | None = Field(
        None,
        description="Replaces the model in the hash salt (model path, dtype, KV-cache dtype, "
        "block size, chunk size), e.g. to share a store between two copies of a model.",
    )
    save_mode: Literal["sync", "background"] = Field(
        "sync",
        description="`sync`: files written in `wait_for_save`, inside the engine step. "
        "`background`: queued for a writer thread; the request's blocks are held until "
        "written.",
    )
    max_pending_saves: Annotated[
        int,
        Field(
            ge=1,
            description="Chunks the background writer may have queued; past that, saves are "
            "dropped (counted).",
        ),
    ] = 64
    max_bytes: int | None = Field(
        None, ge=1, description="Cap on the bytes of chunk files, evicted as `max_chunks`."
    )
    medium: Literal["cpu", "tmpfs", "disk", "remote"] | None = Field(
        None,
        description="What holds the files: the vLLM hit source and the KV events' medium; "
        "unset: from the mount (tmpfs, else disk).",
    )
    admit_min_prompt_tokens: Annotated[
        int, Field(ge=0, description="Save only prompts of at least this many tokens.")
    ] = 0
    admit_min_seen: Annotated[
        int,
        Field(
            ge=1,
            description="Save a chunk only once this many requests carried it (count-min sketch).",
        ),
    ] = 1
    admit_when: RequestCondition | None = Field(
        None,
        description="Save only requests that meet a route rule's conditions: `param` (a "
        "`kv_transfer_params` key, with `equals`), `min_prompt_tokens`, `max_prompt_tokens`, "
        "`predicate`.",
    )
    promote: bool = Field(
        False,
        description="Save chunks another tier loaded for the request, whatever the admission rule.",
    )
    emulate_read: EmulateRead | None = Field(
        None,
        description="**Emulation, for benchmarks**: `{latency_ms: L, gbps: G}` makes every "
        "load take at least L ms + bytes / G GB/s (sleeps after the real read).",
    )

    @field_validator("path", mode="before")
    @classmethod
    def _path_like(cls, value: Any) -> Any:
        """Accept ``pathlib.Path`` and other path objects as well as strings."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PrefixStoreConfig:
        """Validate ``extra``; raises ``ValueError`` with one line naming the bad key (what
        a key must be is its ``Field``'s: ``tree.messages`` words pydantic's error)."""
        extra = dict(extra or {})
        moved = sorted(k for k in extra if k in cls.MOVED and k not in cls.model_fields)
        if moved:
            raise ValueError(
                f"{cls.CONNECTOR}: {moved[0]} is no longer accepted; {cls.MOVED[moved[0]]}"
            )
        try:
            return cls.model_validate(extra)
        except ValidationError as exc:
            raise ValueError(f"{cls.CONNECTOR}: {at(*Wording(cls).problems(exc)[0])}") from None
