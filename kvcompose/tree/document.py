"""A kvcompose config document (version 1): top-level settings and the tree.

::

    version: 1
    kv_role: kv_both            # KVTransferConfig fields every leaf inherits
    hma: auto                   # auto | true | false
    tree:                       # one node
      chain:
        name: tiers
        policy: longest
        children:
          - leaf: {name: ram, connector: ExampleConnector, extra_config: {...}}
          - leaf: {name: disk, connector: ExampleConnector, extra_config: {...}}

The models check structure and types; cross-references (route defaults, unique names, ...)
are checked by ``kvcompose.config``, which knows where each node sits in the file.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from kvcompose.tree.fields import (
    TRANSFER_FIELDS,
    BufferDeviceField,
    EngineIdField,
    FailurePolicyField,
    KvRoleField,
    PermuteField,
    PortField,
    TransferConfigField,
    custom_error,
)
from kvcompose.tree.model import Node, _Model

#: The config format version this code reads and writes.
VERSION = 1


class Document(_Model):
    """A kvcompose config document."""

    version: int = Field(VERSION, description="Config format version. Only 1 exists.")
    kv_role: KvRoleField = None
    engine_id: EngineIdField = None
    kv_buffer_device: BufferDeviceField = None
    kv_port: PortField = None
    enable_permute_local_kv: PermuteField = None
    kv_load_failure_policy: FailurePolicyField = None
    transfer_config: TransferConfigField = Field(default_factory=dict)
    hma: Any = Field(
        "auto",
        description="Hybrid KV cache manager (HMA): `true` requires every leaf to "
        "support it (checked when vLLM is installed) and loads the composite as "
        "`KVComposeHMA`; `false` loads it as `KVCompose`, so vLLM turns HMA off; `auto` picks "
        "`KVComposeHMA` when every leaf supports HMA.",
        json_schema_extra={"anyOf": [{"type": "boolean"}, {"const": "auto"}]},
    )
    strict: bool = Field(
        False,
        description="Composite strict mode, for connector authors' tests: a child "
        "that breaks vLLM's connector contract raises instead of being corrected and logged. "
        "The composite reads it from `kv_connector_extra_config` (`kvcompose vllm-args` puts "
        "it there); `KVCOMPOSE_STRICT=1` also turns it on.",
    )
    tree: Node = Field(..., description="The root node.")

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value != VERSION:
            raise custom_error(
                f"unsupported version {value} (this kvcompose reads version {VERSION})"
            )
        return value

    @field_validator("hma", mode="before")
    @classmethod
    def _hma(cls, value: Any) -> Any:
        if value is True or value is False or value == "auto":
            return value
        raise custom_error(f"must be true, false or 'auto' (got {value!r})")

    def transfer_fields(self) -> dict[str, Any]:
        """The top-level ``KVTransferConfig`` fields, which every leaf inherits."""
        out = {key: getattr(self, key) for key in TRANSFER_FIELDS if getattr(self, key) is not None}
        out.update(self.transfer_config)
        return out


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a config document."""
    schema = Document.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvcompose config"
    return schema
