"""The tree model every layer shares: nodes, documents and their field rules.

The runtime (``kvcompose.composite``) runs these models, ``kvcompose.config`` reads user
documents into them, and the CLI, bench and tests build and print them. Pure pydantic: no
vLLM, no YAML.
"""

from kvcompose.tree.conditions import RequestCondition, load_predicate, matches
from kvcompose.tree.document import VERSION, Document, json_schema
from kvcompose.tree.ejection import EjectRule
from kvcompose.tree.fields import (
    DEFAULT_LOOKUP_TIMEOUT_S,
    KNOWN_KV_TRANSFER_FIELDS,
    NAME_PATTERN,
    OWN_FIELDS,
    TRANSFER_FIELDS,
    ErrorPolicy,
    describe,
)
from kvcompose.tree.inherited_config import child_transfer_config, inherited_fields, transfer_dict
from kvcompose.tree.model import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    NODE_KIND_ERROR,
    NODE_KINDS,
    TREE_KEY,
    Chain,
    Composite,
    ExpectRead,
    Fanout,
    Leaf,
    Node,
    Route,
    RouteRule,
    dump_node,
    effective_saves,
    leaves,
    parse_node,
    walk,
)

__all__ = [
    "DEFAULT_LOOKUP_TIMEOUT_S",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "KNOWN_KV_TRANSFER_FIELDS",
    "NAME_PATTERN",
    "NODE_KINDS",
    "NODE_KIND_ERROR",
    "OWN_FIELDS",
    "TRANSFER_FIELDS",
    "TREE_KEY",
    "VERSION",
    "Chain",
    "Composite",
    "Document",
    "EjectRule",
    "ErrorPolicy",
    "ExpectRead",
    "Fanout",
    "Leaf",
    "Node",
    "RequestCondition",
    "Route",
    "RouteRule",
    "child_transfer_config",
    "describe",
    "dump_node",
    "effective_saves",
    "inherited_fields",
    "json_schema",
    "leaves",
    "load_predicate",
    "matches",
    "parse_node",
    "transfer_dict",
    "walk",
]
