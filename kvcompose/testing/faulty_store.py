"""``FaultyPrefixStoreConnector``: the prefix store with injected load failures.

Tests of load-failure handling (vLLM's ``kv_load_failure_policy``, a composite's fallback
to its next child) need a real store whose load fails for chosen requests. The product
store has no such switch; this subclass adds one extra-config key and otherwise is the
store itself, so everything else a test observes is real. Name it in a config as::

    kv_connector: FaultyPrefixStoreConnector
    kv_connector_module_path: kvcompose.testing.faulty_store
    kv_connector_extra_config: {path: ..., fail_load_request_ids: [r0]}

(in a kvcompose tree: ``connector: FaultyPrefixStoreConnector``, ``module_path:
kvcompose.testing.faulty_store``).

``fail_load_request_ids`` (list[str])
    The worker reports every load of a matching request as failed without reading the
    store: request-level ``failed_recving`` in async mode, the request's loaded blocks in
    ``get_block_ids_with_load_errors`` in sync mode. An entry matches the engine-internal id
    itself or the id a client chose (vLLM appends ``-<8 random chars>`` to it). With
    ``kv_load_failure_policy="recompute"`` vLLM then recomputes the prompt; the scheduler
    side does not offer the store to a request again after an async failure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, field_validator

from kvcompose.stores.prefix.config import PrefixStoreConfig
from kvcompose.stores.prefix.connector import PrefixStoreConnector
from kvcompose.stores.prefix.worker import LoadProgress, PrefixStoreWorker

if TYPE_CHECKING:
    import torch

    from kvcompose.stores.prefix.metadata import LoadSpec

logger = logging.getLogger(__name__)

#: How configs name the class (``kv_connector`` / a leaf's ``connector``).
CONNECTOR = "FaultyPrefixStoreConnector"
#: Its module (``kv_connector_module_path`` / a leaf's ``module_path``).
MODULE_PATH = "kvcompose.testing.faulty_store"


def request_id_matches(req_id: str, patterns: Iterable[str]) -> bool:
    """``req_id`` is a pattern, or a pattern plus vLLM's ``-<8 random chars>`` suffix."""
    return any(
        req_id == p or (req_id.startswith(f"{p}-") and len(req_id) == len(p) + 9) for p in patterns
    )


class FaultyPrefixStoreConfig(PrefixStoreConfig):
    """The store's extra config plus ``fail_load_request_ids``."""

    CONNECTOR: ClassVar[str] = "FaultyPrefixStoreConnector"
    MOVED: ClassVar[dict[str, str]] = {}

    fail_load_request_ids: tuple[str, ...] = Field(
        (), description="Requests whose loads fail (see the module docstring)."
    )

    @field_validator("fail_load_request_ids", mode="before")
    @classmethod
    def _list_of_ids(cls, value: Any) -> Any:
        """YAML and JSON give lists; ``None`` means none. A bare string is refused (it
        would otherwise read as a list of characters)."""
        if value is None:
            return ()
        return tuple(value) if isinstance(value, list) else value


class FaultyPrefixStoreWorker(PrefixStoreWorker):
    """The worker half, failing the loads of the configured requests."""

    config: FaultyPrefixStoreConfig

    def load(self, spec: LoadSpec, caches: dict[str, torch.Tensor]) -> bool:
        if request_id_matches(spec.req_id, self.config.fail_load_request_ids):
            logger.info("PrefixStoreConnector: injected load failure for %s", spec.req_id)
            return self.report_load(spec, LoadProgress(failed_from=0), time.perf_counter())
        return super().load(spec, caches)


class FaultyPrefixStoreConnector(PrefixStoreConnector):
    """:class:`PrefixStoreConnector` with ``fail_load_request_ids`` (see the module docstring)."""

    config_class: ClassVar[type[PrefixStoreConfig]] = FaultyPrefixStoreConfig
    worker_class: ClassVar[type[PrefixStoreWorker]] = FaultyPrefixStoreWorker
