"""Field types shared by the tree's models, each declared once with its description.

A field used by several models (``name``, ``save``, ``on_error``, the ``KVTransferConfig``
fields a leaf or a document may set) is an ``Annotated`` type here, so every model lists its
fields in its own order (the order dumps and the reference docs show) without repeating
validation rules or documentation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

#: Default seconds a composite waits for children that answer ``None`` ("still looking").
DEFAULT_LOOKUP_TIMEOUT_S = 30.0

#: KVTransferConfig fields (vLLM 0.32/0.33) that may be set at the top of a document or on a
#: leaf, with their types as the schema checks them. A leaf inherits what it does not set.
TRANSFER_FIELDS: tuple[str, ...] = (
    "kv_role",
    "engine_id",
    "kv_buffer_device",
    "kv_port",
    "enable_permute_local_kv",
    "kv_load_failure_policy",
)
#: KVTransferConfig fields that are never inherited: every leaf sets its own.
OWN_FIELDS: tuple[str, ...] = (
    "kv_connector",
    "kv_connector_module_path",
    "kv_connector_extra_config",
)
#: All KVTransferConfig fields known without importing vLLM.
KNOWN_KV_TRANSFER_FIELDS: tuple[str, ...] = OWN_FIELDS + TRANSFER_FIELDS
#: ``transfer_config`` keys that belong elsewhere, with the key to use instead.
_OWN_FIELD_KEYS = {
    "kv_connector": "connector",
    "kv_connector_module_path": "module_path",
    "kv_connector_extra_config": "extra_config",
}

#: Node names: letters, digits, ``_`` and ``-`` (no dots: ``name.key`` addresses overrides).
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$"


def custom_error(message: str) -> PydanticCustomError:
    """A validation error whose message is shown to the user as it is."""
    return PydanticCustomError("kvcompose", message)


def describe(value: Any) -> str:
    """A short description of a value for "got ..." messages."""
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "a mapping",
        type(None): "null",
    }
    kind = names.get(type(value), type(value).__name__)
    if isinstance(value, (bool, int, float)) or value is None:
        return f"{kind} ({value!r})" if value is not None else kind
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"{kind} ({shown!r})"
    return kind


def _no_known_fields(value: dict[str, Any]) -> dict[str, Any]:
    for key in value:
        if key in OWN_FIELDS:
            raise custom_error(
                f"{key!r} cannot be set here: use the leaf's {_OWN_FIELD_KEYS[key]!r}"
            )
        if key in TRANSFER_FIELDS:
            raise custom_error(
                f"{key!r} has its own key: set {key!r} directly, not under transfer_config"
            )
    return value


ErrorPolicy = Literal["miss", "fail"]
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]

KvRoleField = Annotated[
    KVRole | None,
    Field(
        description="Whether this engine produces, consumes or both produces and consumes KV "
        "caches: `kv_producer`, `kv_consumer` or `kv_both`."
    ),
]
EngineIdField = Annotated[
    str | None, Field(description="The engine id for KV transfers (vLLM makes one up when unset).")
]
BufferDeviceField = Annotated[
    str | None, Field(description="Device the connector buffers KV on: `cuda`, `cpu`, `xpu`, ...")
]
PortField = Annotated[
    int | None, Field(ge=1, le=65535, description="Port the connector uses for its connections.")
]
PermuteField = Annotated[
    bool | None, Field(description="vLLM's experimental HND to NHD KV transfer flag.")
]
FailurePolicyField = Annotated[
    Literal["recompute", "fail"] | None,
    Field(
        description="What vLLM does when a KV load fails: `recompute` the failed blocks (needed "
        "for falling back to another child) or `fail` the request."
    ),
]
TransferConfigField = Annotated[
    dict[str, Any],
    AfterValidator(_no_known_fields),
    Field(
        description="Any other KVTransferConfig field (for vLLM versions newer than this schema). "
        "Checked against vLLM's KVTransferConfig when vLLM is installed."
    ),
]

SaveField = Annotated[
    bool,
    Field(
        description="Whether this node saves KV caches (when "
        "false, none of its leaves save, whatever their "
        "own flag)."
    ),
]
OnErrorField = Annotated[
    ErrorPolicy,
    Field(
        description="When a child (or the leaf's connector) raises: `miss` treats it as a cache "
        "miss and carries on, `fail` lets the error through to vLLM."
    ),
]
LookupTimeoutField = Annotated[
    float,
    Field(
        gt=0,
        description='Seconds to wait for children that answer a lookup with "still '
        'looking" before treating them as a miss.',
    ),
]
