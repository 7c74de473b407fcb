"""A scripted stand-in for vLLM's ``LMCacheMPConnector`` on the scheduler harness, where no
``lmcache server`` runs: a ``ScriptedConnector`` that keeps the one rule of the real
connector a composite must obey, that a request it is told about was asked about first.

What it imitates (vLLM 0.32, ``lmcache_mp_connector.py``):

- ``get_num_new_matched_tokens`` makes the request's tracker
  (``_get_or_create_request_tracker``); while its lookup is in flight it answers ``None``
  (``scheduler_adapter.check_lookup_result``; ``Behaviour.pending_lookups`` here);
- ``update_state_after_alloc`` and ``build_connector_meta`` (``_process_new_requests``, for
  every newly scheduled request) look the tracker up with ``_get_request_tracker``, which
  asserts that it exists; told 0, ``update_state_after_alloc`` moves a prefetching tracker
  to ``READY`` (its lookup cancelled).

Its class name is the real one's, so kvcompose's facts about ``LMCacheMPConnector`` apply
to it. ``tests/lmcache_mp`` runs the real connector against a real server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcompose.testing.scripted import ScriptedConnector, leaf

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

MODULE_PATH = "kvcompose.testing.lmcache_mp_double"


class LMCacheMPConnector(ScriptedConnector):
    """A scripted child with ``LMCacheMPConnector``'s request trackers (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trackers: set[str] = set()

    def _tracker(self, req_id: str) -> None:
        # the real ``_get_request_tracker``'s assert, word for word
        assert req_id in self.trackers, f"Request tracker for request_id {req_id} not found. "

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.trackers.add(request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._tracker(request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        for new_request in scheduler_output.scheduled_new_reqs:
            self._tracker(new_request.req_id)
        return super().build_connector_meta(scheduler_output)


def lmcache_mp_leaf(name: str, script_name: str | None = None, **fields: Any) -> dict[str, Any]:
    """A leaf running the double with the script ``script_name`` (default: ``name``)."""
    fields = {"connector": "LMCacheMPConnector", "module_path": MODULE_PATH, **fields}
    return leaf(name, script_name, **fields)
