"""The pydantic schema of a kvcompose config document (version 1).

A document is a mapping::

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

A node is a mapping with exactly one key, its kind: ``leaf``, ``chain``, ``fanout`` or
``route``. The models only check structure and types; cross-references (route defaults,
unique names, ...) are checked by ``kvcompose.config.load``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvcompose.spec import DEFAULT_LOOKUP_TIMEOUT_S

#: The config format version this code reads and writes.
VERSION = 1

#: KVTransferConfig fields (vLLM 0.32/0.33) that may be set at the top of a document or on a
#: leaf, with their types as the schema checks them. A leaf inherits what it does not set.
TRANSFER_FIELDS: tuple[str, ...] = (
    "kv_role", "engine_id", "kv_buffer_device", "kv_port", "enable_permute_local_kv",
    "kv_load_failure_policy",
)
#: KVTransferConfig fields that are never inherited: every leaf sets its own.
OWN_FIELDS: tuple[str, ...] = (
    "kv_connector", "kv_connector_module_path", "kv_connector_extra_config",
)
#: All KVTransferConfig fields known without importing vLLM.
KNOWN_KV_TRANSFER_FIELDS: tuple[str, ...] = OWN_FIELDS + TRANSFER_FIELDS

NODE_KINDS: tuple[str, ...] = ("leaf", "chain", "fanout", "route")

#: Node names: letters, digits, ``_`` and ``-`` (no dots: ``name.key`` addresses overrides).
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$"

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


def _custom(message: str) -> PydanticCustomError:
    return PydanticCustomError("kvcompose", message)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TransferFields(_Strict):
    """KVTransferConfig fields; on a leaf they override what the leaf inherits."""

    kv_role: KVRole | None = Field(
        None, description="Whether this engine produces, consumes or both produces and "
        "consumes KV caches: `kv_producer`, `kv_consumer` or `kv_both`.")
    engine_id: str | None = Field(
        None, description="The engine id for KV transfers (vLLM makes one up when unset).")
    kv_buffer_device: str | None = Field(
        None, description="Device the connector buffers KV on: `cuda`, `cpu`, `xpu`, ...")
    kv_port: int | None = Field(None, ge=1, le=65535,
                                description="Port the connector uses for its connections.")
    enable_permute_local_kv: bool | None = Field(
        None, description="vLLM's experimental HND to NHD KV transfer flag.")
    kv_load_failure_policy: Literal["recompute", "fail"] | None = Field(
        None, description="What vLLM does when a KV load fails: `recompute` the failed "
        "blocks (needed for falling back to another child) or `fail` the request.")
    transfer_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other KVTransferConfig field (for vLLM versions newer than this "
        "schema). Checked against vLLM's KVTransferConfig when vLLM is installed.")

    @field_validator("transfer_config")
    @classmethod
    def _no_known_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in OWN_FIELDS:
                short = {"kv_connector": "connector", "kv_connector_module_path": "module_path",
                         "kv_connector_extra_config": "extra_config"}[key]
                raise _custom(f"{key!r} cannot be set here: use the leaf's {short!r}")
            if key in TRANSFER_FIELDS:
                raise _custom(f"{key!r} has its own key: set {key!r} directly, "
                              "not under transfer_config")
        return value


class LeafModel(TransferFields):
    """One vLLM connector."""

    name: str | None = Field(
        None, pattern=NAME_PATTERN,
        description="Unique node name (default: the connector name, made unique with "
        "`-2`, `-3`, ...). Used in stats, logs, route rules and overrides.")
    connector: str = Field(
        ..., min_length=1,
        description="A registered vLLM connector name (`ExampleConnector`, `NixlConnector`, "
        "`OffloadingConnector`, ...) or, with `module_path`, a class name in that module.")
    module_path: str | None = Field(
        None, min_length=1,
        description="Python module to import the connector class from "
        "(vLLM's `kv_connector_module_path`).")
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The connector's own `kv_connector_extra_config`, passed as is.")
    save: bool = Field(True, description="Whether this leaf saves KV caches.")
    on_error: Literal["miss", "fail"] = Field(
        "miss", description="When the connector raises: `miss` treats it as a cache miss and "
        "carries on, `fail` lets the error through to vLLM.")
    params_keys: list[str] | None = Field(
        None, description="The `kv_transfer_params` keys this connector produces when a "
        "request finishes. Known P/D connectors (NIXL, Mooncake, MoRIIO) need nothing here; "
        "set `[]` to declare that a connector produces none. Only used for the clash check.")


class _CompositeModel(_Strict):
    name: str | None = Field(
        None, pattern=NAME_PATTERN,
        description="Unique node name (default: the kind, `chain`, `fanout` or `route`, "
        "made unique with `-2`, ...).")
    children: list[NodeEntry] = Field(..., description="The child nodes, in order.",
                                      json_schema_extra={"minItems": 1})
    lookup_timeout_s: float = Field(
        DEFAULT_LOOKUP_TIMEOUT_S, gt=0,
        description="Seconds to wait for children that answer a lookup with \"still "
        "looking\" before treating them as a miss.")
    save: bool = Field(True, description="Whether this subtree saves (when false, none of "
                                         "its leaves save, whatever their own flag).")
    on_error: Literal["miss", "fail"] = Field(
        "miss", description="When a child raises: `miss` treats it as a miss, `fail` lets "
        "the error through.")

    @field_validator("children", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise _custom("is empty: a composite needs at least one child")
        return value


class ChainModel(_CompositeModel):
    """Ordered lookup."""

    policy: Literal["first", "longest"] = Field(
        "first", description="`first`: the first child in order with a hit loads it. "
        "`longest`: the child with the longest hit loads it (ties go to the earlier child).")


class FanoutModel(_CompositeModel):
    """Save to every child; load from one named child or from none."""

    load_from: str | None = Field(
        None, description="Name of the child that lookups and loads go to; null: never load.")


class RuleModel(_Strict):
    """One routing rule: every condition given must hold."""

    child: str = Field(..., description="Name of the child that handles matching requests.")
    param: str | None = Field(
        None, description="A key that must be present in the request's `kv_transfer_params`.")
    equals: Any = Field(
        None, description="With `param`: the value that key must have (any JSON value).")
    min_prompt_tokens: int | None = Field(
        None, ge=0, description="The prompt must have at least this many tokens.")
    max_prompt_tokens: int | None = Field(
        None, ge=0, description="The prompt must have at most this many tokens.")
    predicate: str | None = Field(
        None, description="`package.module:function`, called as `function(request) -> bool`.")

    @model_validator(mode="after")
    def _conditions(self) -> RuleModel:
        if "equals" in self.model_fields_set and self.param is None:
            raise _custom("'equals' needs 'param' (the kv_transfer_params key to compare)")
        if (self.param is None and self.min_prompt_tokens is None
                and self.max_prompt_tokens is None and self.predicate is None):
            raise _custom("a rule needs a condition (param, min_prompt_tokens, "
                          "max_prompt_tokens or predicate); use the route's 'default' for "
                          "the catch-all child")
        if (self.min_prompt_tokens is not None and self.max_prompt_tokens is not None
                and self.min_prompt_tokens > self.max_prompt_tokens):
            raise _custom(f"min_prompt_tokens ({self.min_prompt_tokens}) is greater than "
                          f"max_prompt_tokens ({self.max_prompt_tokens})")
        if self.predicate is not None:
            module, _, attr = self.predicate.partition(":")
            if not module or not attr or not all(
                    part.isidentifier() for part in module.split(".") + attr.split(".")):
                raise _custom(f"predicate {self.predicate!r} is not of the form "
                              "'package.module:function'")
        return self


class RouteModel(_CompositeModel):
    """Per request, exactly one child looks up and loads: the first matching rule's, else
    the default."""

    default: str = Field(..., description="Name of the child used when no rule matches.")
    rules: list[RuleModel] = Field(default_factory=list,
                                   description="Rules, tried in order; the first match wins.")


class NodeEntry(_Strict):
    """A node: a mapping with exactly one of `leaf`, `chain`, `fanout`, `route`."""

    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"minProperties": 1, "maxProperties": 1})

    leaf: LeafModel | None = None
    chain: ChainModel | None = None
    fanout: FanoutModel | None = None
    route: RouteModel | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        kinds = [k for k in NODE_KINDS if k in value]
        if len(kinds) > 1:
            raise _custom(f"a node has exactly one kind, got {' and '.join(kinds)}: "
                          "put the others under 'children'")
        if kinds:
            if value[kinds[0]] is None:
                raise _custom(f"'{kinds[0]}' is empty")
            return value
        if "connector" in value:
            raise _custom("a node needs its kind: write 'leaf: {connector: ...}'")
        if "children" in value:
            raise _custom("a node needs its kind: write 'chain:', 'fanout:' or 'route:' "
                          "above 'children'")
        if not value:
            raise _custom("empty node: expected one of leaf, chain, fanout, route")
        return value  # unknown keys: reported with "did you mean"

    @model_validator(mode="after")
    def _has_kind(self) -> NodeEntry:
        if self.body is None:  # pragma: no cover - the before-validator catches it
            raise _custom("expected one of leaf, chain, fanout, route")
        return self

    @property
    def kind(self) -> str:
        for kind in NODE_KINDS:
            if getattr(self, kind) is not None:
                return kind
        raise AssertionError("node without kind")

    @property
    def body(self) -> LeafModel | ChainModel | FanoutModel | RouteModel | None:
        for kind in NODE_KINDS:
            if getattr(self, kind) is not None:
                return getattr(self, kind)
        return None


class Document(TransferFields):
    """A kvcompose config document."""

    version: int = Field(VERSION, description="Config format version. Only 1 exists.")
    hma: Any = Field(
        "auto", description="Hybrid KV cache manager (HMA): `true` requires every leaf to "
        "support it (checked when vLLM is installed) and loads the composite as "
        "`KVComposeHMA`; `false` loads it as `KVCompose`, so vLLM turns HMA off; `auto` picks "
        "`KVComposeHMA` when every leaf supports HMA.",
        json_schema_extra={"anyOf": [{"type": "boolean"}, {"const": "auto"}]})
    strict: bool = Field(
        False, description="Composite strict mode, for connector authors' tests: a child "
        "that breaks vLLM's connector contract raises instead of being corrected and logged. "
        "The composite reads it from `kv_connector_extra_config` (`kvcompose vllm-args` puts "
        "it there); `KVCOMPOSE_STRICT=1` also turns it on.")
    tree: NodeEntry = Field(..., description="The root node.")

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value != VERSION:
            raise _custom(f"unsupported version {value} (this kvcompose reads version "
                          f"{VERSION})")
        return value

    @field_validator("hma", mode="before")
    @classmethod
    def _hma(cls, value: Any) -> Any:
        if value is True or value is False or value == "auto":
            return value
        raise _custom(f"must be true, false or 'auto' (got {value!r})")


_CompositeModel.model_rebuild()
ChainModel.model_rebuild()
FanoutModel.model_rebuild()
RouteModel.model_rebuild()
NodeEntry.model_rebuild()
Document.model_rebuild()


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a config document."""
    schema = Document.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "kvcompose config"
    return schema
