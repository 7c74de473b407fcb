"""A recording ExampleConnector: every call one child receives, in order, summarised.

For differential tests: the same run under two composites (vLLM's ``MultiConnector`` and
``kvcompose.compat.MultiConnector``), each child's calls compared. A child is vLLM's own
``ExampleConnector`` unchanged (it stores and loads for real); the subclass only records.

The scheduler and worker instances of one child record into the same log, found by name
(``kv_connector_extra_config: {"record_as": NAME}``) in the process-wide ``LOGS``: both
roles must run in one process (the scheduler harness, a single-process engine).

Each entry is ``(role, method, arguments, result)`` with values summarised so that two runs
compare equal when the child was told the same things: request ids become their order of
first appearance (``r0``, ``r1``...; vLLM adds random suffixes), blocks their ids, tensors
their shapes, metadata the requests it carries, objects the child cannot look into (the
forward context, attention metadata) their type names. Class-level members (layout, stats
and metrics builders) are not recorded: they are not called on the child instance.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)

Entry = tuple[str, str, tuple[Any, ...], Any]


class Log(list[Entry]):
    """One child's calls; ``ids`` numbers request ids in order of first appearance."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, str] = {}

    def request(self, req_id: str) -> str:
        return self.ids.setdefault(req_id, f"r{len(self.ids)}")

    def methods(self, role: str | None = None) -> list[str]:
        return [m for r, m, _, _ in self if role is None or r == role]


#: Every recording child's log, by its ``record_as`` name.
LOGS: dict[str, Log] = {}


def recording_leaf(name: str, path: Any, **fields: Any) -> dict[str, Any]:
    """A kvcompose tree leaf running the recording ExampleConnector under ``path``."""
    return {
        "kind": "leaf",
        "name": name,
        "connector": "RecordingExampleConnector",
        "module_path": __name__,
        "extra_config": {"shared_storage_path": str(path), "record_as": name},
        **fields,
    }


def summarise(value: Any, log: Log) -> Any:
    """A comparable, run-independent summary of what a child was handed or returned."""
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return log.ids.get(value, value)
    if isinstance(value, Request):
        return log.request(value.request_id)
    if isinstance(value, ForwardContext):
        return "ForwardContext"  # the layers and attention metadata of the step
    if isinstance(value, KVCacheBlocks):
        return ("blocks", tuple(tuple(group) for group in value.get_block_ids()))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape))
    if isinstance(value, SchedulerOutput):
        new = tuple(log.request(r.req_id) for r in value.scheduled_new_reqs)
        cached = tuple(log.request(r) for r in value.scheduled_cached_reqs.req_ids)
        tokens = summarise(value.num_scheduled_tokens, log)
        return ("scheduled", new, cached, tokens, summarise(value.finished_req_ids, log))
    if isinstance(value, ExampleConnectorMetadata):
        return (
            "example_meta",
            tuple(
                (int(r.token_ids.numel()), r.is_store, tuple(r.slot_mapping.tolist()))
                for r in value.requests
            ),
        )
    if isinstance(value, list | tuple):
        return tuple(summarise(v, log) for v in value)
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted((summarise(v, log) for v in value), key=repr)))
    if isinstance(value, dict):
        items = ((summarise(k, log), summarise(v, log)) for k, v in value.items())
        return ("dict", tuple(sorted(items, key=repr)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(
            (f.name, summarise(getattr(value, f.name), log)) for f in dataclasses.fields(value)
        )
        return (type(value).__name__, fields)
    return type(value).__name__


def _instance_methods() -> list[str]:
    """The public members of vLLM's base class that vLLM calls on a connector instance."""
    names = []
    for name, member in inspect.getmembers(KVConnectorBase_V1):
        raw = inspect.getattr_static(KVConnectorBase_V1, name)
        if name.startswith("_") or isinstance(raw, classmethod | staticmethod | property):
            continue
        if callable(member):
            names.append(name)
    return names


def _recorded(name: str) -> Callable[..., Any]:
    def method(self: RecordingExampleConnector, *args: Any, **kwargs: Any) -> Any:
        result = getattr(super(RecordingExampleConnector, self), name)(*args, **kwargs)
        if inspect.isgenerator(result) or isinstance(result, map | filter):
            result = list(result)
        log = self.recording
        summary = summarise(args, log) + summarise(tuple(sorted(kwargs.items())), log)
        log.append((self.role.name, name, summary, summarise(result, log)))
        return result

    method.__name__ = name
    return method


class RecordingExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector, recording every instance call into ``LOGS[record_as]``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        name = vllm_config.kv_transfer_config.get_from_extra_config("record_as", None)
        if not name:
            raise ValueError("RecordingExampleConnector needs extra config 'record_as'")
        self.recording = LOGS.setdefault(name, Log())
        super().__init__(vllm_config, role, kv_cache_config)


for _name in _instance_methods():
    setattr(RecordingExampleConnector, _name, _recorded(_name))


def clear(names: Iterable[str] | None = None) -> None:
    """Forget the logs of ``names`` (default: all)."""
    for name in list(LOGS) if names is None else names:
        LOGS.pop(name, None)


__all__ = ["LOGS", "Log", "RecordingExampleConnector", "clear", "recording_leaf", "summarise"]
