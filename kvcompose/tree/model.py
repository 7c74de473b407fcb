"""The one tree model: a kvcompose tree as frozen pydantic models.

A tree is made of four node kinds. ``Leaf`` names one vLLM connector; ``Chain``, ``Fanout``
and ``Route`` hold children and differ only in *who is asked to look up and load* (their
lookup policy). Who *saves* is the same rule everywhere: every child whose ``save`` is true.

The same models read the user's documents (through ``kvcompose.config``, which adds file
names, line numbers and cross-checks), are what the composite runs, and are what a composite
hands a nested composite through vLLM's ``kv_connector_extra_config`` (``TREE_KEY``). A node
is accepted in two spellings:

- the document form, one key naming the kind: ``{"leaf": {"connector": ...}}``;
- the canonical form, a ``kind`` key: ``{"kind": "leaf", "connector": ...}``, which is what
  ``dump_node`` writes.

Names are optional in a document (``kvcompose.config`` fills them in); the runtime only sees
named trees. Nothing here imports vLLM or YAML.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    model_validator,
)

from kvcompose.tree.conditions import RequestCondition
from kvcompose.tree.ejection import EjectField
from kvcompose.tree.fields import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    NAME_PATTERN,
    TRANSFER_FIELDS,
    BufferDeviceField,
    EngineIdField,
    FailurePolicyField,
    KvRoleField,
    LookupTimeoutField,
    OnErrorField,
    PermuteField,
    PortField,
    SaveField,
    TransferConfigField,
    custom_error,
    describe,
)
from kvcompose.tree.ranges import RangeMode, RangeSupport, range_support

#: ``policy: fastest``'s priors until measured: a load's fixed cost and bandwidth, and the
#: engine's prefill speed (a CPU engine's order of magnitude; a GPU's is 10-100x).
DEFAULT_READ_LATENCY_MS = 1.0
DEFAULT_READ_GBPS = 1.0
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0

#: Key under which a composite passes a validated subtree to a nested composite.
TREE_KEY = "kvcompose_tree"

NODE_KINDS: tuple[str, ...] = ("leaf", "chain", "fanout", "route")

#: Longest connector class name or module path accepted (Python names are far shorter).
MAX_NAME_LENGTH = 200

#: The custom error type of a mapping that is no node of any kind (see ``_kind_of``).
NODE_KIND_ERROR = "kvcompose_node"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Node(_Model):
    """What every node shares: reading the document form, and ``kind`` in every dump."""

    kind: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _document_form(cls, value: Any) -> Any:
        """``{"leaf": {...}}`` -> the body; the tag has already chosen the model."""
        if isinstance(value, dict) and len(value) == 1 and cls.kind in value:
            body = value[cls.kind]
            if not isinstance(body, dict):
                raise custom_error(f"expected a mapping, got {describe(body)}")
            return body
        if isinstance(value, dict) and value.get("kind") == cls.kind:
            return {k: v for k, v in value.items() if k != "kind"}
        return value

    @property
    def composite(self) -> bool:
        return self.kind != "leaf"


NodeName = Annotated[
    str | None,
    Field(
        pattern=NAME_PATTERN,
        description="Unique node name (default: the connector name for a leaf, the kind for a "
        "composite, made unique with `-2`, `-3`, ...). Used in stats, logs, route rules and "
        "overrides.",
    ),
]


class ExpectRead(_Model):
    """What a child's loads are expected to cost until ``policy: fastest`` has measured them:
    ``latency_ms`` per load plus its bytes at ``gbps`` (GB/s, 10^9 bytes)."""

    latency_ms: float = Field(
        DEFAULT_READ_LATENCY_MS, ge=0, allow_inf_nan=False, description="Fixed cost of a load (ms)."
    )
    gbps: float = Field(
        DEFAULT_READ_GBPS, gt=0, allow_inf_nan=False, description="Bandwidth of a load (GB/s)."
    )


class Leaf(_Node):
    """One vLLM connector.

    ``connector`` is a registered vLLM connector name (``ExampleConnector``,
    ``NixlConnector``, ...) or a class name found in ``module_path``. The ``KVTransferConfig``
    fields it sets (``kv_role``, ``engine_id``, ..., and any other under ``transfer_config``)
    override what it inherits from its parent's config.
    """

    kind: ClassVar[str] = "leaf"

    name: NodeName = None
    connector: str = Field(
        ...,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="A registered vLLM connector name (`ExampleConnector`, `NixlConnector`, "
        "`OffloadingConnector`, ...) or, with `module_path`, a class name in that module.",
    )
    module_path: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="Python module to import the connector class from "
        "(vLLM's `kv_connector_module_path`).",
    )
    kv_role: KvRoleField = None
    engine_id: EngineIdField = None
    kv_buffer_device: BufferDeviceField = None
    kv_port: PortField = None
    enable_permute_local_kv: PermuteField = None
    kv_load_failure_policy: FailurePolicyField = None
    transfer_config: TransferConfigField = Field(default_factory=dict)
    extra_config: dict[str, Any] = Field(
        default_factory=dict,
        description="The connector's own `kv_connector_extra_config`, passed as is.",
    )
    save: SaveField = True
    on_error: OnErrorField = "miss"
    eject: EjectField = None
    params_keys: list[str] | None = Field(
        None,
        description="The `kv_transfer_params` keys this connector produces when a "
        "request finishes. Known P/D connectors (NIXL, Mooncake, MoRIIO) need nothing here; "
        "set `[]` to declare that a connector produces none. Only used for the clash check.",
    )
    load_range: RangeMode | None = Field(
        None,
        description="How this connector takes part in a `stitch` chain's loads: `native` "
        "(any range), `last_segment` (from a start to its own end, last only), `natural_end` "
        "(from a start to its own end, sync stitches only) or `sole_owner` (only as the one "
        "loader). Default: from the connector class (kvcompose's store and vLLM's "
        "OffloadingConnector native, NixlConnector last segment, LMCacheConnectorV1 natural "
        "end, anything else sole owner).",
    )
    load_range_alignment: int | None = Field(
        None,
        ge=1,
        description="Token multiple a `stitch` segment of this connector must start on "
        "(default: the block size; LMCacheConnectorV1: its chunk size, 256).",
    )

    expect_read: ExpectRead | None = Field(
        None,
        description="For a `fastest` chain: what this connector's loads cost until they "
        "are measured, `{latency_ms, gbps}`: a fixed cost per load (ms, >= 0) plus its bytes "
        f"at a bandwidth (GB/s, > 0); default {DEFAULT_READ_LATENCY_MS:g} ms + "
        f"{DEFAULT_READ_GBPS:g} GB/s, and the child starts cold: probed with two short loads "
        "before its times are trusted. Its timed loads replace it.",
    )

    def range_support(self) -> RangeSupport:
        """How this leaf takes part in stitched loads (``kvcompose.tree.ranges``)."""
        return range_support(self.connector, self.load_range, self.load_range_alignment)

    def transfer_fields(self) -> dict[str, Any]:
        """The ``KVTransferConfig`` fields this leaf sets itself."""
        out = {key: getattr(self, key) for key in TRANSFER_FIELDS if getattr(self, key) is not None}
        out.update(self.transfer_config)
        return out


def _not_empty(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and not value:
        raise custom_error("is empty: a composite needs at least one child")
    return value


Children = Annotated[
    tuple["Node", ...],
    BeforeValidator(_not_empty),
    Field(
        strict=False, description="The child nodes, in order.", json_schema_extra={"minItems": 1}
    ),
]


class Chain(_Node):
    """Ordered lookup. ``first``: the first child (in order) with a hit owns the load.
    ``longest``: the child with the most tokens owns it; ties go to the earlier child.
    ``stitch``: each child in order loads the range after what the earlier ones cover.
    ``fastest``: per request, the plan with the least predicted time to first token: recompute,
    one child's load, or stitched segments with the rest recomputed, by measured costs."""

    kind: ClassVar[str] = "chain"

    name: NodeName = None
    policy: Literal["first", "longest", "stitch", "fastest"] = Field(
        "first",
        description="`first`: the first child in order with a hit loads it. "
        "`longest`: the child with the longest hit loads it (ties go to the earlier child). "
        "`stitch`: children in order each load the range after what the earlier ones cover "
        "(each as its `load_range` mode allows). "
        "`fastest`: per request, whichever of recomputing, one child's load or a stitch of "
        "segments (the rest recomputed) has the least predicted time to first token, from "
        "the children's measured load costs and the engine's measured prefill speed "
        "(docs/concepts.md, 'Loading only what pays').",
    )
    expect_prefill_tokens_per_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="For `fastest`: the engine's prefill speed (tokens/s) until it is measured "
        f"(default: {DEFAULT_PREFILL_TOKENS_PER_S:g}).",
    )
    lookup_timeout_s: LookupTimeoutField = DEFAULT_LOOKUP_TIMEOUT_S
    save: SaveField = True
    on_error: OnErrorField = "miss"
    eject: EjectField = None
    children: Children


class Fanout(_Node):
    """Saves to every child; loads from none (``load_from`` null) or from one named child."""

    kind: ClassVar[str] = "fanout"

    name: NodeName = None
    load_from: str | None = Field(
        None, description="Name of the child that lookups and loads go to; null: never load."
    )
    lookup_timeout_s: LookupTimeoutField = DEFAULT_LOOKUP_TIMEOUT_S
    save: SaveField = True
    on_error: OnErrorField = "miss"
    eject: EjectField = None
    children: Children


class RouteRule(RequestCondition):
    """Sends a request's lookup to ``child`` when every condition given here holds.

    - ``param``: a key of the request's ``kv_transfer_params`` must be present
      (and equal ``equals`` when that is given, ``null`` included);
    - ``min_prompt_tokens`` / ``max_prompt_tokens``: inclusive bounds on the prompt length;
    - ``predicate``: ``"package.module:function"``, called as ``function(request) -> bool``.
    """

    EMPTY_HINT: ClassVar[str] = (
        "a rule needs a condition (param, min_prompt_tokens, "
        "max_prompt_tokens or predicate); use the route's 'default' for "
        "the catch-all child"
    )

    child: str = Field(..., description="Name of the child that handles matching requests.")


class Route(_Node):
    """Per request, exactly one child (the first rule that matches, else ``default``)
    handles lookups and loads. Saves follow the usual save rule."""

    kind: ClassVar[str] = "route"

    name: NodeName = None
    default: str = Field(..., description="Name of the child used when no rule matches.")
    rules: tuple[RouteRule, ...] = Field(
        (), strict=False, description="Rules, tried in order; the first match wins."
    )
    lookup_timeout_s: LookupTimeoutField = DEFAULT_LOOKUP_TIMEOUT_S
    save: SaveField = True
    on_error: OnErrorField = "miss"
    eject: EjectField = None
    children: Children


def _kind_of(value: Any) -> str | None:
    """The node kind of ``value`` in either spelling; None makes pydantic report a
    ``NODE_KIND_ERROR`` at the node, which ``kvcompose.config`` turns into messages."""
    if isinstance(value, dict):
        if "kind" in value:
            kind = value["kind"]
            return kind if kind in NODE_KINDS else None
        return next(iter(value)) if len(value) == 1 and next(iter(value)) in NODE_KINDS else None
    kind = getattr(value, "kind", None)
    return kind if isinstance(value, _Node) else None


def _node_shape(value: Any) -> Any:
    """Clear messages for the mistakes a node's shape invites, before the kind is chosen."""
    if not isinstance(value, dict) or "kind" in value:
        return value
    kinds = [k for k in NODE_KINDS if k in value]
    if len(kinds) > 1:
        raise custom_error(
            f"a node has exactly one kind, got {' and '.join(kinds)}: "
            "put the others under 'children'"
        )
    if kinds and value[kinds[0]] is None:
        raise custom_error(f"'{kinds[0]}' is empty")
    if not kinds:
        if "connector" in value:
            raise custom_error("a node needs its kind: write 'leaf: {connector: ...}'")
        if "children" in value:
            raise custom_error(
                "a node needs its kind: write 'chain:', 'fanout:' or 'route:' above 'children'"
            )
        if not value:
            raise custom_error("empty node: expected one of leaf, chain, fanout, route")
    return value


class _DocumentFormSchema:
    """The JSON Schema of a node in the document form: one key, the kind, holding the
    body (the canonical ``kind`` form is for kvcompose itself and not advertised)."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        bodies = handler(core_schema)["oneOf"]
        return {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {kind: body},
                    "required": [kind],
                    "additionalProperties": False,
                }
                for kind, body in zip(NODE_KINDS, bodies, strict=True)
            ],
            "description": "A node: a mapping with exactly one of `leaf`, `chain`, "
            "`fanout`, `route`.",
        }


Node = Annotated[
    Annotated[Leaf, Tag("leaf")]
    | Annotated[Chain, Tag("chain")]
    | Annotated[Fanout, Tag("fanout")]
    | Annotated[Route, Tag("route")],
    Discriminator(
        _kind_of,
        custom_error_type=NODE_KIND_ERROR,
        custom_error_message="expected one of leaf, chain, fanout, route",
    ),
    BeforeValidator(_node_shape),
    _DocumentFormSchema(),
]
Composite = Chain | Fanout | Route

for _model in (Chain, Fanout, Route):
    _model.model_rebuild()

_NODE = TypeAdapter(Node)


def parse_node(data: Any) -> Leaf | Chain | Fanout | Route:
    """A node from either spelling; raises pydantic's ``ValidationError``."""
    return _NODE.validate_python(data)


def dump_node(node: Leaf | Chain | Fanout | Route) -> dict[str, Any]:
    """The canonical, JSON-able form of a tree (``kind`` keys, only what was set), which
    ``parse_node`` reads back to an equal tree."""
    data = node.model_dump(mode="json", exclude_unset=True)
    out: dict[str, Any] = {"kind": node.kind}
    out.update(data)
    if node.composite:
        out["children"] = [dump_node(child) for child in node.children]  # type: ignore[union-attr]
    return out


def walk(
    node: Leaf | Chain | Fanout | Route, depth: int = 0
) -> Iterator[tuple[int, Leaf | Chain | Fanout | Route]]:
    """Depth-first, parents before children."""
    yield depth, node
    if node.composite:
        for child in node.children:  # type: ignore[union-attr]
            yield from walk(child, depth + 1)


def leaves(node: Leaf | Chain | Fanout | Route) -> list[Leaf]:
    return [n for _, n in walk(node) if isinstance(n, Leaf)]


def effective_saves(tree: Leaf | Chain | Fanout | Route) -> list[tuple[Leaf, bool]]:
    """Every leaf with whether it really saves (its flag and every ancestor's)."""
    out: list[tuple[Leaf, bool]] = []

    def visit(node: Leaf | Chain | Fanout | Route, parent_saves: bool) -> None:
        saves = parent_saves and node.save
        if isinstance(node, Leaf):
            out.append((node, saves))
        else:
            for child in node.children:
                visit(child, saves)

    visit(tree, True)
    return out
