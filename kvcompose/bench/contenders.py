"""Contenders of ``kvcompose bench``: what each compared engine runs as its KV connector.

A contender is given on the command line as ``[LABEL=]SPEC`` (``-c``/``--contender``; the
older ``--chain`` is kept as an alias; a contender need not be a kvcompose ``chain``):

- ``none`` (or ``recompute``): no connector; every prompt token is computed. Greedy outputs of
  the other contenders are compared with this one.
- a kvcompose config file (YAML or JSON: ``version``/``tree``...), loaded with
  ``kvcompose.config`` and run as the ``KVCompose`` connector;
- a vLLM ``--kv-transfer-config`` JSON file (any dict with ``kv_connector``: vLLM's own
  ``MultiConnector``, a single connector, ...), passed to vLLM unchanged;
- ``builtin:NAME`` for one of ``BUILTIN_CONTENDERS`` (the default comparison).

**Stores.** Inside a contender file, ``{store:NAME}`` stands for a fresh directory on disk and
``{tmpfs:NAME}`` for one in tmpfs (``/dev/shm``). Every contender gets its own fresh copies;
a store whose NAME matches one of the workload's prefill sets (the built-in workloads fill
``fast`` and ``disk``) starts with that content, built once by a preparation engine and
copied, so every contender starts from identical stores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``{store:NAME}`` (a directory on disk) and ``{tmpfs:NAME}`` (a directory in tmpfs).
PLACEHOLDER = re.compile(r"\{(store|tmpfs):([A-Za-z0-9_][A-Za-z0-9_.-]*)\}")

STORE_CONNECTOR = "PrefixStoreConnector"
STORE_MODULE = "kvcompose.stores"
#: Keys of a PrefixStoreConnector's extra config that do not change what it stores; the
#: preparation engine drops them, so it writes the prepared prompts whole, in the step
#: (no capacity, admission, promotion or background writer).
_STORE_RUNTIME_KEYS = (
    "path",
    "read_only",
    "max_chunks",
    "max_bytes",
    "load_mode",
    "save_mode",
    "max_pending_saves",
    "admit_min_prompt_tokens",
    "admit_min_seen",
    "promote",
    "medium",
    "admit_when",
    "emulate_read",
    "fail_load_request_ids",
)


class ContenderError(ValueError):
    """A contender cannot be read or resolved; the message names it."""


@dataclass
class ContenderDef:
    """A contender as given: its label, where it came from and its raw text."""

    label: str
    source: str  # "none", "builtin:NAME" or a file path
    kind: str  # "none" | "kvcompose" | "vllm"
    text: str | None = None  # raw file text, placeholders unresolved
    fmt: str = "yaml"  # "yaml" | "json"
    description: str = ""

    def store_refs(self) -> dict[str, str]:
        """``{NAME: "store"|"tmpfs"}`` for every placeholder in the text."""
        if not self.text:
            return {}
        return {name: where for where, name in PLACEHOLDER.findall(self.text)}


@dataclass
class StoreLeaf:
    """A leaf that stores into a placeholder directory: how to fill that store beforehand."""

    store: str
    connector: str
    module_path: str | None
    extra_config: dict[str, Any]

    def prep_config(self, path: str) -> dict[str, Any]:
        """A single-connector ``KVTransferConfig`` dict that writes this store at ``path``."""
        extra = dict(self.extra_config)
        if self.connector == STORE_CONNECTOR:
            for key in _STORE_RUNTIME_KEYS:
                extra.pop(key, None)
            extra["path"] = path
        else:
            extra = _replace_value(extra, self.extra_config_path_value, path)
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if self.module_path:
            cfg["kv_connector_module_path"] = self.module_path
        return cfg

    #: The placeholder directory as it appears in the extra config (set by ``resolve``).
    extra_config_path_value: str = ""

    def variant(self) -> str:
        """What must agree for two contenders to share one prepared copy of this store."""
        extra = {
            k: v
            for k, v in self.extra_config.items()
            if not (self.connector == STORE_CONNECTOR and k in _STORE_RUNTIME_KEYS)
            and v != self.extra_config_path_value
        }
        key = json.dumps([self.connector, self.module_path, extra], sort_keys=True, default=str)
        return hashlib.sha1(key.encode()).hexdigest()[:10]


@dataclass
class ResolvedContender:
    """A contender ready to run: its vLLM ``kv_transfer_config`` and its store directories."""

    contender: ContenderDef
    kv_transfer_config: dict[str, Any] | None
    stores: dict[str, str] = field(default_factory=dict)  # NAME -> directory
    store_kinds: dict[str, str] = field(default_factory=dict)  # NAME -> "store" | "tmpfs"
    store_leaves: list[StoreLeaf] = field(default_factory=list)
    connector: str = "none"  # what vLLM loads, for reports
    tree: Any = None  # the kvcompose tree, for kvcompose contenders


# --------------------------------------------------------------------------- built-ins


def _store_leaf_json(name: str, path: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": STORE_CONNECTOR,
        "kv_connector_module_path": STORE_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"path": path, **extra},
    }


#: The fast tier: a read-only tmpfs store filled before the run (the short shared prefixes).
FAST_TIER = {"path": "{tmpfs:fast}", "read_only": True}
#: The disk tier: a read-write store on disk (long prefixes; saves everything it sees).
DISK_TIER = {"path": "{store:disk}"}


#: ``fastest``'s priors for the two local tiers, as an operator states what they know: the
#: store loads from tmpfs and page-cached disk at 3-4 GB/s on a 2-core CPU machine.
#: Without them a fresh engine's first request probes each tier (docs/concepts.md).
LOCAL_TIER_PRIOR = "{latency_ms: 1, gbps: 1}"


def kvcompose_chain_yaml(
    policy: str, *, note: str = "", disk_options: str = "", priors: tuple[str, str] = ("", "")
) -> str:
    """A kvcompose config: a chain of the two store tiers ``fast`` (tmpfs, read-only) and
    ``disk`` under ``policy``. ``note``: comment lines after the header; ``disk_options``:
    more of the disk tier's ``extra_config`` (``, emulate_read: {...}``); ``priors``: each
    tier's ``expect_read`` (a YAML flow mapping, or "" for none). Used by the built-in
    contenders and the benchmarks that vary them."""
    fast_prior, disk_prior = (f"\n          expect_read: {p}" if p else "" for p in priors)
    return f"""\
# kvcompose chain over two PrefixStoreConnector tiers, policy: {policy}.
# {{tmpfs:fast}} / {{store:disk}} are replaced by `kvcompose bench` with fresh
# per-contender directories (tmpfs / disk) that start with the workload's prepared contents.{note}
version: 1
kv_role: kv_both
tree:
  chain:
    name: tiers
    policy: {policy}
    children:
      - leaf:
          name: fast
          connector: {STORE_CONNECTOR}
          module_path: {STORE_MODULE}
          extra_config: {{path: "{FAST_TIER["path"]}", read_only: true}}{fast_prior}
      - leaf:
          name: disk
          connector: {STORE_CONNECTOR}
          module_path: {STORE_MODULE}
          extra_config: {{path: "{DISK_TIER["path"]}"{disk_options}}}{disk_prior}
"""


def _kvcompose_yaml(policy: str) -> str:
    if policy != "fastest":
        return kvcompose_chain_yaml(policy)
    return kvcompose_chain_yaml(
        policy,
        note="\n# fastest: both tiers are local, their speeds stated as priors (expect_read); "
        "without them\n# a fresh engine's first request probes each tier.",
        priors=(LOCAL_TIER_PRIOR, LOCAL_TIER_PRIOR),
    )


BUILTIN_CONTENDERS: dict[str, tuple[str, str, str | None]] = {
    # name: (kind, description, text)
    "recompute": ("none", "no connector: every prompt token is computed", None),
    "disk": (
        "vllm",
        "one disk tier: PrefixStoreConnector on {store:disk}, called directly",
        json.dumps(_store_leaf_json("disk", DISK_TIER["path"]), indent=2),
    ),
    "multiconnector": (
        "vllm",
        "vLLM MultiConnector over [fast (tmpfs, read-only), disk]: first hit loads",
        json.dumps(
            {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "connectors": [
                        _store_leaf_json("fast", FAST_TIER["path"], read_only=True),
                        _store_leaf_json("disk", DISK_TIER["path"]),
                    ]
                },
            },
            indent=2,
        ),
    ),
    "kvcompose-first": (
        "kvcompose",
        "kvcompose chain [fast, disk], policy first",
        _kvcompose_yaml("first"),
    ),
    "kvcompose-longest": (
        "kvcompose",
        "kvcompose chain [fast, disk], policy longest",
        _kvcompose_yaml("longest"),
    ),
    "kvcompose-stitch": (
        "kvcompose",
        "kvcompose chain [fast, disk], policy stitch: fast loads its prefix, disk only the rest",
        _kvcompose_yaml("stitch"),
    ),
    "kvcompose-fastest": (
        "kvcompose",
        "kvcompose chain [fast, disk], policy fastest: per request the plan with the least "
        "predicted TTFT, from measured load and prefill costs (the local tiers' speeds given "
        "as priors)",
        _kvcompose_yaml("fastest"),
    ),
}

DEFAULT_CONTENDERS = tuple(BUILTIN_CONTENDERS)


def builtin_contender(name: str, label: str | None = None) -> ContenderDef:
    if name not in BUILTIN_CONTENDERS:
        raise ContenderError(
            f"unknown built-in contender {name!r}; known: {', '.join(BUILTIN_CONTENDERS)}"
        )
    kind, description, text = BUILTIN_CONTENDERS[name]
    return ContenderDef(
        label=label or name,
        source=f"builtin:{name}",
        kind=kind,
        text=text,
        fmt="yaml" if kind == "kvcompose" else "json",
        description=description,
    )


def write_builtin_contenders(
    out_dir: str | os.PathLike[str], names: Iterable[str] = DEFAULT_CONTENDERS
) -> list[Path]:
    """Write the built-in contender files (for users to copy and edit)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        contender = builtin_contender(name)
        if contender.text is None:
            continue
        path = out / f"{name}.{'yaml' if contender.fmt == 'yaml' else 'json'}"
        text = contender.text
        path.write_text(text if text.endswith("\n") else text + "\n")
        written.append(path)
    return written


# --------------------------------------------------------------------------- parsing


_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_label(text: str) -> str:
    """A label from a file name: what ``LABEL=`` accepts (it names directories and table
    rows), other characters replaced by ``-``."""
    label = _NOT_LABEL.sub("-", text).lstrip(".-")[:64]
    return label or "contender"


def parse_contender(arg: str) -> ContenderDef:
    """``[LABEL=]none|recompute|builtin:NAME|PATH`` → ``ContenderDef`` (raises
    ``ContenderError``)."""
    label: str | None = None
    spec = arg
    head, sep, tail = arg.partition("=")
    if sep and _LABEL.match(head) and not os.path.exists(arg):
        label, spec = head, tail
    if spec in ("none", "recompute"):
        return ContenderDef(
            label=label or "recompute",
            source="none",
            kind="none",
            description="no connector: every prompt token is computed",
        )
    if spec.startswith("builtin:"):
        return builtin_contender(spec.split(":", 1)[1], label)
    if spec in BUILTIN_CONTENDERS and not os.path.exists(spec):
        return builtin_contender(spec, label)
    path = Path(spec)
    if not path.is_file():  # a FIFO or a device would block or never end
        why = "not a regular file" if path.exists() else "no such file"
        raise ContenderError(
            f"contender {arg!r}: {why} (and not none/recompute or "
            f"builtin:NAME with NAME in {', '.join(BUILTIN_CONTENDERS)})"
        )
    from kvcompose.config import ConfigError
    from kvcompose.config.files import read_bytes

    try:
        text = read_bytes(str(path)).decode("utf-8")  # bounded like any config file
    except ConfigError as exc:
        raise ContenderError(f"contender {arg!r}: {exc}") from None
    except UnicodeDecodeError:
        raise ContenderError(f"contender {arg!r}: {path}: not UTF-8 text") from None
    fmt = "json" if path.suffix.lower() == ".json" else "yaml"
    kind = "kvcompose"
    if fmt == "json":
        try:
            data = json.loads(PLACEHOLDER.sub("x", text))
        except ValueError as exc:
            raise ContenderError(f"contender {arg!r}: {path}: not valid JSON ({exc})") from None
        if isinstance(data, Mapping) and "kv_connector" in data:
            kind = "vllm"
            if data.get("kv_connector") in ("KVCompose", "KVComposeHMA"):
                kind = "kvcompose"
    return ContenderDef(
        label=label or safe_label(path.stem),
        source=str(path),
        kind=kind,
        text=text,
        fmt=fmt,
        description=f"{'kvcompose config' if kind == 'kvcompose' else 'vLLM config'} {path}",
    )


def unique_labels(contenders: list[ContenderDef]) -> None:
    """Make labels unique in place (``-2``, ``-3``...)."""
    seen: dict[str, int] = {}
    for contender in contenders:
        base = contender.label
        n = seen.get(base, 0) + 1
        seen[base] = n
        if n > 1:
            contender.label = f"{base}-{n}"


def _replace_value(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return new if value == old else value
    if isinstance(value, Mapping):
        return {k: _replace_value(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_value(v, old, new) for v in value]
    return value
