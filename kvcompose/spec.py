"""The in-memory connector tree: what a validated config becomes.

A tree is made of four node kinds. ``LeafSpec`` names one vLLM connector; ``ChainSpec``,
``FanoutSpec`` and ``RouteSpec`` hold children and differ only in *who is asked to look up
and load* (their lookup policy). Who *saves* is the same rule everywhere: every child whose
``save`` flag is true.

These are plain frozen dataclasses with no vLLM import, so configs can be validated, drawn
and converted without vLLM installed. ``to_dict``/``from_dict`` give the canonical dict form;
it is also how a composite hands a subtree to a nested composite through vLLM's
``kv_connector_extra_config`` (see ``TREE_KEY``). User input goes through ``kvcompose.config``,
which validates with pydantic and produces these objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: Key under which a composite passes a pre-validated subtree to a nested composite.
TREE_KEY = "kvcompose_tree"

ErrorPolicy = Literal["miss", "fail"]
ChainPolicy = Literal["first", "longest"]

#: Default seconds a composite waits for children that answer ``None`` ("still looking").
DEFAULT_LOOKUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class LeafSpec:
    """One vLLM connector.

    ``connector`` is a registered vLLM connector name (``ExampleConnector``, ``NixlConnector``,
    ...) or a class name found in ``module_path``. ``transfer_config`` holds any other
    ``KVTransferConfig`` field for this child (``kv_role``, ``engine_id``, ``kv_buffer_device``,
    ...); fields it does not set are inherited from the top-level config.
    """

    name: str
    connector: str
    module_path: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    transfer_config: Mapping[str, Any] = field(default_factory=dict)
    save: bool = True
    on_error: ErrorPolicy = "miss"

    kind: Literal["leaf"] = field(default="leaf", init=False)


@dataclass(frozen=True)
class ChainSpec:
    """Ordered lookup. ``first``: the first child (in order) with a hit owns the load.
    ``longest``: the child with the most tokens owns it; ties go to the earlier child."""

    name: str
    children: tuple[NodeSpec, ...]
    policy: ChainPolicy = "first"
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    save: bool = True
    on_error: ErrorPolicy = "miss"

    kind: Literal["chain"] = field(default="chain", init=False)


@dataclass(frozen=True)
class FanoutSpec:
    """Saves to every child; loads from none (``load_from=None``) or from one named child."""

    name: str
    children: tuple[NodeSpec, ...]
    load_from: str | None = None
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    save: bool = True
    on_error: ErrorPolicy = "miss"

    kind: Literal["fanout"] = field(default="fanout", init=False)


@dataclass(frozen=True)
class RouteRule:
    """Sends a request's lookup to ``child`` when every condition given here holds.

    - ``param``: a key of the request's ``kv_transfer_params`` must be present
      (and equal ``equals`` when that is given);
    - ``min_prompt_tokens`` / ``max_prompt_tokens``: inclusive bounds on the prompt length;
    - ``predicate``: ``"package.module:function"``, called as ``function(request) -> bool``.
    """

    child: str
    param: str | None = None
    equals: Any = None
    has_equals: bool = False
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    predicate: str | None = None


@dataclass(frozen=True)
class RouteSpec:
    """Per request, exactly one child (the first rule that matches, else ``default``)
    handles lookups and loads. Saves follow the usual save rule."""

    name: str
    children: tuple[NodeSpec, ...]
    default: str
    rules: tuple[RouteRule, ...] = ()
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    save: bool = True
    on_error: ErrorPolicy = "miss"

    kind: Literal["route"] = field(default="route", init=False)


NodeSpec = LeafSpec | ChainSpec | FanoutSpec | RouteSpec
CompositeSpec = ChainSpec | FanoutSpec | RouteSpec


def walk(spec: NodeSpec, depth: int = 0) -> Iterator[tuple[int, NodeSpec]]:
    """Depth-first, parents before children."""
    yield depth, spec
    if not isinstance(spec, LeafSpec):
        for child in spec.children:
            yield from walk(child, depth + 1)


def leaves(spec: NodeSpec) -> list[LeafSpec]:
    return [node for _, node in walk(spec) if isinstance(node, LeafSpec)]


# --------------------------------------------------------------------------- dict form


def to_dict(spec: NodeSpec) -> dict[str, Any]:
    """The canonical, JSON-able dict form of a tree (what ``from_dict`` reads back)."""
    if isinstance(spec, LeafSpec):
        out: dict[str, Any] = {"kind": "leaf", "name": spec.name, "connector": spec.connector}
        if spec.module_path:
            out["module_path"] = spec.module_path
        if spec.extra_config:
            out["extra_config"] = dict(spec.extra_config)
        if spec.transfer_config:
            out["transfer_config"] = dict(spec.transfer_config)
    else:
        out = {"kind": spec.kind, "name": spec.name,
               "children": [to_dict(c) for c in spec.children],
               "lookup_timeout_s": spec.lookup_timeout_s}
        if isinstance(spec, ChainSpec):
            out["policy"] = spec.policy
        elif isinstance(spec, FanoutSpec):
            out["load_from"] = spec.load_from
        else:
            out["default"] = spec.default
            out["rules"] = [_rule_to_dict(r) for r in spec.rules]
    out["save"] = spec.save
    out["on_error"] = spec.on_error
    return out


def _rule_to_dict(rule: RouteRule) -> dict[str, Any]:
    out: dict[str, Any] = {"child": rule.child}
    for key in ("param", "min_prompt_tokens", "max_prompt_tokens", "predicate"):
        value = getattr(rule, key)
        if value is not None:
            out[key] = value
    if rule.has_equals:
        out["equals"] = rule.equals
    return out


def from_dict(data: Mapping[str, Any]) -> NodeSpec:
    """Read the canonical dict form back. No validation beyond structure: user input
    goes through ``kvcompose.config``, which reports errors with their path."""
    kind = data["kind"]
    common = {"name": data["name"], "save": data.get("save", True),
              "on_error": data.get("on_error", "miss")}
    if kind == "leaf":
        return LeafSpec(connector=data["connector"], module_path=data.get("module_path"),
                        extra_config=dict(data.get("extra_config", {})),
                        transfer_config=dict(data.get("transfer_config", {})), **common)
    children = tuple(from_dict(c) for c in data["children"])
    timeout = data.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)
    if kind == "chain":
        return ChainSpec(children=children, policy=data.get("policy", "first"),
                         lookup_timeout_s=timeout, **common)
    if kind == "fanout":
        return FanoutSpec(children=children, load_from=data.get("load_from"),
                          lookup_timeout_s=timeout, **common)
    if kind == "route":
        rules = tuple(
            RouteRule(child=r["child"], param=r.get("param"), equals=r.get("equals"),
                      has_equals="equals" in r, min_prompt_tokens=r.get("min_prompt_tokens"),
                      max_prompt_tokens=r.get("max_prompt_tokens"),
                      predicate=r.get("predicate"))
            for r in data.get("rules", ()))
        return RouteSpec(children=children, default=data["default"], rules=rules,
                         lookup_timeout_s=timeout, **common)
    raise ValueError(f"unknown node kind {kind!r}")
