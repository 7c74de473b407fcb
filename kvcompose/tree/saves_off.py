"""What ``save: false`` changes in a leaf's own ``KVTransferConfig``, per connector.

A composite calls ``save_kv_layer`` and ``wait_for_save`` only on children that save. That
is all most connectors need. A few plan their saves on the scheduler side whatever the
composite does, and finish them only in the worker's ``wait_for_save``; for those, the
leaf's config is changed so that they plan none:

- vLLM's ``OffloadingConnector`` plans store jobs in ``build_connector_meta``
  (``OffloadingConnectorScheduler._build_store_jobs``) and runs them in its worker's
  ``wait_for_save``. Jobs that never run never complete: the chunks stay ``HIT_PENDING``
  (``CPUOffloadingManager.lookup``), so its lookups answer "still looking" (``None``) until
  the composite's lookup deadline, and ``has_pending_push_work`` stays true. The leaf gets
  an unreachable ``store_threshold``: ``CPUOffloadingManager.prepare_store`` then offers no
  key to store, and ``_build_store_jobs`` builds no job (vLLM 0.32 and 0.33). A
  ``max_tracker_size`` of 0 keeps the manager's offer counts empty. Only
  ``CPUOffloadingSpec`` (and specs built on it) read that threshold;
  ``TieringOffloadingSpec`` refuses it, so ``save: false`` is refused there.
- kvcompose's ``PrefixStoreConnector`` plans saves only as a producer
  (``saves_enabled``); as ``kv_consumer`` it still loads and keeps its files' recency.
- ``NixlConnector`` (and its pull/push variants) does not save: it sends a request's KV to a
  decode instance when the request asks (``do_remote_decode``), which ``save: false``
  cannot stop, and with a host buffer (``kv_buffer_device: cpu`` on an accelerator) it
  copies the blocks there in ``wait_for_save`` before the send. Skipping that call would
  send stale bytes, so ``save: false`` is refused on these leaves.

Pure dicts, no vLLM import: ``kvcompose.composite`` and the config checks both call it.
"""

from __future__ import annotations

from typing import Any

#: ``store_threshold`` no chunk reaches: the number of times it must be offered to be stored.
UNREACHABLE_STORE_THRESHOLD = 1 << 62

#: The offloading specs whose manager reads ``store_threshold`` (``CPUOffloadingSpec.
#: get_manager``); ``None`` is vLLM's default spec.
_THRESHOLD_SPECS = frozenset({None, "CPUOffloadingSpec"})

_NIXL = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})


class SaveFalseRefused(ValueError):
    """``save: false`` cannot be honoured by this leaf's connector."""


def _vllm_class(fields: dict[str, Any], names: frozenset[str]) -> bool:
    """Whether the fields name one of vLLM's own classes (registered: no module path)."""
    return fields.get("kv_connector") in names and not fields.get("kv_connector_module_path")


def _prefix_store(fields: dict[str, Any]) -> bool:
    module = str(fields.get("kv_connector_module_path") or "")
    return fields.get("kv_connector") == "PrefixStoreConnector" and module.startswith(
        "kvcompose.stores"
    )


def without_saves(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a leaf's ``KVTransferConfig`` keyword arguments) changed so that its
    connector plans no saves; raises ``SaveFalseRefused`` where it cannot be."""
    out = dict(fields)
    connector = out.get("kv_connector")
    if _vllm_class(out, frozenset({"OffloadingConnector"})):
        extra = dict(out.get("kv_connector_extra_config") or {})
        spec = extra.get("spec_name")
        if spec not in _THRESHOLD_SPECS and not extra.get("spec_module_path"):
            raise SaveFalseRefused(
                f"save: false: OffloadingConnector with spec {spec!r} cannot be kept from "
                "storing (kvcompose sets store_threshold, which only CPUOffloadingSpec and "
                "specs built on it read); remove save: false or use CPUOffloadingSpec"
            )
        extra["store_threshold"] = UNREACHABLE_STORE_THRESHOLD
        extra["max_tracker_size"] = 0
        out["kv_connector_extra_config"] = extra
    elif _vllm_class(out, _NIXL):
        raise SaveFalseRefused(
            f"save: false does not apply to {connector}: it sends KV when a request asks "
            "(do_remote_decode), not by saving, and with a host buffer it copies the "
            "blocks for the send in wait_for_save, which save: false skips; remove "
            "save: false from this leaf"
        )
    elif _prefix_store(out) and out.get("kv_role") in (None, "kv_both"):
        out["kv_role"] = "kv_consumer"
    return out
