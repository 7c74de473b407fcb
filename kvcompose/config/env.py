"""Overrides: environment variables and override keys in ``kv_connector_extra_config``.

Precedence, lowest first: schema defaults < the document (a file, or the inline document in
``kv_connector_extra_config``) < environment variables < override keys in
``kv_connector_extra_config`` (the top-level keys given next to ``config: path``, and ``set``).

Environment variables (in the style of vLLM's ``VLLM_*`` and LMCache's ``LMCACHE_*``):

- ``KVCOMPOSE_CONFIG_FILE``: the file to read when ``kv_connector_extra_config`` names none;
- ``KVCOMPOSE_<FIELD>`` for each top-level field: ``KVCOMPOSE_KV_ROLE``,
  ``KVCOMPOSE_ENGINE_ID``, ``KVCOMPOSE_KV_BUFFER_DEVICE``, ``KVCOMPOSE_KV_PORT``,
  ``KVCOMPOSE_KV_LOAD_FAILURE_POLICY``, ``KVCOMPOSE_ENABLE_PERMUTE_LOCAL_KV``,
  ``KVCOMPOSE_HMA``;
- ``KVCOMPOSE_SET``: ``node.key=value`` assignments separated by ``;`` or newlines, e.g.
  ``tiers.policy=first; disk.extra_config.shared_storage_path=/mnt/kv``. Values are read as
  YAML scalars (``true``, ``30``, ``[a, b]``); quote strings that look like numbers.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvcompose.config.errors import ConfigError, did_you_mean, shown, shown_list
from kvcompose.tree import NODE_KINDS, TRANSFER_FIELDS

ENV_PREFIX = "KVCOMPOSE_"
ENV_CONFIG_FILE = "KVCOMPOSE_CONFIG_FILE"
ENV_SET = "KVCOMPOSE_SET"

#: Top-level document fields that have a ``KVCOMPOSE_<FIELD>`` variable.
ENV_FIELDS: tuple[str, ...] = (*TRANSFER_FIELDS, "hma")
#: Fields whose environment value is taken as a string, not parsed as YAML.
_STRING_FIELDS = frozenset({"engine_id", "kv_buffer_device", "kv_role", "kv_load_failure_policy"})


@dataclass(frozen=True)
class Override:
    """One assignment: ``key`` is a top-level field, or ``node.key[.subkey...]``."""

    source: str  # e.g. "KVCOMPOSE_SET 'disk.save=false'"
    key: str
    value: Any


def parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: 5,000 digits
        return text


def env_overrides(env: Mapping[str, str]) -> list[Override]:
    """The overrides the environment asks for, in the order they apply."""
    out: list[Override] = []
    for field in ENV_FIELDS:
        var = ENV_PREFIX + field.upper()
        if env.get(var, "").strip():  # set and not empty
            raw = env[var].strip()
            value = raw if field in _STRING_FIELDS else parse_value(raw)
            if field == "hma" and isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            out.append(Override(f"{var}={raw}", field, value))
    if env.get(ENV_SET, "").strip():
        out.extend(parse_assignments(env[ENV_SET], ENV_SET))
    return out


def parse_assignments(text: str, source: str) -> list[Override]:
    out = []
    for part in text.replace("\n", ";").split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{source}: {shown(part)} is not of the form 'node.key=value'")
        out.append(Override(f"{source} {shown(part)}", key, parse_value(value.strip())))
    return out


def mapping_overrides(values: Mapping[str, Any], source: str) -> list[Override]:
    """Overrides given as a mapping (``set: {"disk.save": false}`` in extra config)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{source}: expected a mapping of 'node.key' to values")
    return [Override(f"{source} {key!r}", str(key), value) for key, value in values.items()]


def _node_bodies(tree: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, body) for every node of a normalised document tree (names filled in)."""
    if not isinstance(tree, dict):
        return
    for kind in NODE_KINDS:
        body = tree.get(kind)
        if isinstance(body, dict):
            yield body.get("name", ""), body
            for child in body.get("children") or ():
                yield from _node_bodies(child)


def apply_override(document: dict[str, Any], override: Override) -> dict[str, Any]:
    """A copy of the (normalised) document with ``override`` applied."""
    doc = copy.deepcopy(document)
    if "." not in override.key:
        if override.key in ("tree", "version"):
            raise ConfigError(f"{override.source}: {override.key!r} cannot be overridden")
        doc[override.key] = override.value  # unknown keys are reported by validation
        return doc
    name, *keys = override.key.split(".")
    bodies = dict(_node_bodies(doc.get("tree")))
    if name not in bodies:
        raise ConfigError(
            f"{override.source}: no node named {shown(name)}"
            f"{did_you_mean(name, bodies)} (nodes: {shown_list(bodies)})"
        )
    if keys[0] in ("children", "name"):
        raise ConfigError(
            f"{override.source}: {keys[0]!r} cannot be overridden "
            "(overrides change settings, not the shape of the tree)"
        )
    target = bodies[name]
    for key in keys[:-1]:
        nxt = target.get(key)
        if nxt is None:
            nxt = target[key] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{override.source}: {key!r} of node {name!r} is not a mapping")
        target = nxt
    target[keys[-1]] = override.value
    return doc


def environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env
