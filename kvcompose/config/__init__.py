"""Declarative connector trees: YAML/JSON/dict configs -> validated ``kvcompose.tree`` trees.

Public API:

- ``load_tree(source)``: a file path (YAML or JSON) or a dict in the user format -> a tree node;
- ``load_config(source)``: the same, with everything the CLI needs (``Config``);
- ``tree_from_extra_config(extra)``: what the KVCompose connector calls with its
  ``kv_connector_extra_config``;
- ``child_transfer_config(parent, leaf)``: a child's ``KVTransferConfig`` keyword arguments,
  inheriting the parent's fields;
- ``ConfigError``: raised for bad input, with a one-line message naming the path in the file.

See ``docs/config.md`` for the file format. Nothing here imports vLLM unless vLLM is
installed and the checks that need it run. Any input, however large, deep, self-referring
or malformed, ends in a result or a ``ConfigError`` within bounded work
(``kvcompose.config.limits``).
"""

from kvcompose.config.compile import NodeInfo
from kvcompose.config.errors import ConfigError, ErrorItem
from kvcompose.config.load import (
    Config,
    config_from_extra_config,
    load_config,
    load_tree,
    tree_from_extra_config,
    vllm_available,
)
from kvcompose.tree import VERSION, child_transfer_config, effective_saves, json_schema

__all__ = [
    "VERSION",
    "Config",
    "ConfigError",
    "ErrorItem",
    "NodeInfo",
    "child_transfer_config",
    "config_from_extra_config",
    "effective_saves",
    "json_schema",
    "load_config",
    "load_tree",
    "tree_from_extra_config",
    "vllm_available",
]
