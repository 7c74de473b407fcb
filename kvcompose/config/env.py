"""Overrides: environment variables and override keys in ``kv_connector_extra_config``.

Precedence, lowest first: schema defaults < the document (a file, or the inline document in
``kv_connector_extra_config``) < environment variables < override keys in
``kv_connector_extra_config`` (the top-level keys given next to ``config: path``, and ``set``).

Environment variables (in the style of vLLM's ``VLLM_*`` and LMCache's ``LMCACHE_*``):

- ``KVCOMPOSE_CONFIG_FILE``: the file to read when ``kv_connector_extra_config`` names none;
- ``KVCOMPOSE_SET``: ``key=value`` assignments separated by ``;`` or newlines, ``key`` a
  top-level field or ``node.key``, e.g. ``kv_role=kv_producer; tiers.policy=first``. Values
  are read as YAML scalars (``true``, ``30``, ``[a, b]``); quote strings that look like
  numbers.

One variable per top-level field (``KVCOMPOSE_KV_ROLE``, ...) was a second way to say what
``KVCOMPOSE_SET`` says, with its own parsing rules; such a variable is refused with the
``KVCOMPOSE_SET`` assignment that replaces it, never silently ignored.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvcompose.config import parse
from kvcompose.config.document_form import node_bodies
from kvcompose.config.errors import ConfigError, shown_list
from kvcompose.config.walk import check_plain
from kvcompose.tree import TRANSFER_FIELDS
from kvcompose.tree.error_messages import did_you_mean, shown

ENV_CONFIG_FILE = "KVCOMPOSE_CONFIG_FILE"
ENV_SET = "KVCOMPOSE_SET"
#: The per-field variables older releases read (``KVCOMPOSE_KV_ROLE``, ...).
_DROPPED = {f"KVCOMPOSE_{field.upper()}": field for field in (*TRANSFER_FIELDS, "hma")}


@dataclass(frozen=True)
class Override:
    """One assignment: ``key`` is a top-level field, or ``node.key[.subkey...]``."""

    source: str  # e.g. "KVCOMPOSE_SET 'disk.save=false'"
    key: str
    value: Any


def parse_value(text: str, source: str) -> Any:
    """A YAML value read as files are (``parse``; a repeated key is refused); text YAML
    cannot read is taken as it is."""
    try:
        read = parse.read(text)
    except (yaml.YAMLError, RecursionError):
        return text
    if read is None:
        return None
    check_plain(read[0], source, marks=parse.Marks(duplicates=read[1].duplicates))
    return read[0]


def env_overrides(env: Mapping[str, str]) -> list[Override]:
    """The overrides the environment asks for (``KVCOMPOSE_SET``), in the order they apply."""
    for var, field in _DROPPED.items():
        if env.get(var, "").strip():
            raise ConfigError(
                f"{var} is no longer read: set top-level fields with {ENV_SET}, e.g. "
                f"{ENV_SET}={shown(f'{field}={env[var].strip()}')}"
            )
    if not env.get(ENV_SET, "").strip():
        return []
    return parse_assignments(env[ENV_SET], ENV_SET)


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
        label = f"{source} {shown(part)}"
        out.append(Override(label, key, parse_value(value.strip(), label)))
    return out


def mapping_overrides(values: Mapping[str, Any], source: str) -> list[Override]:
    """Overrides given as a mapping (``set: {"disk.save": false}`` in extra config)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{source}: expected a mapping of 'node.key' to values")
    return [Override(f"{source} {key!r}", str(key), value) for key, value in values.items()]


def apply_override(document: dict[str, Any], override: Override) -> dict[str, Any]:
    """A copy of the (normalised) document with ``override`` applied."""
    doc = copy.deepcopy(document)
    if "." not in override.key:
        if override.key in ("tree", "version"):
            raise ConfigError(f"{override.source}: {override.key!r} cannot be overridden")
        doc[override.key] = override.value  # unknown keys are reported by validation
        return doc
    name, *keys = override.key.split(".")
    # a normalised document: every node is named
    bodies = {body.get("name", ""): body for _, body in node_bodies(doc.get("tree"))}
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
