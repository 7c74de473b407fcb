"""A drop-in for vLLM's ``MultiConnector``.

vLLM special-cases the literal connector name ``MultiConnector`` (NIXL config fix-ups, HMA
support through ``MultiConnector.all_children_support_hma``, SimpleCPUOffload discovery), one
level deep. Exporting the composite under that name keeps those checks working: an existing
MultiConnector user switches by adding one line to the same JSON::

    {"kv_connector": "MultiConnector", "kv_connector_module_path": "kvcompose.compat",
     "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [...]}}

The ``connectors`` list is a chain, as upstream (``multi_connector.py`` in vLLM 0.32 and
0.33): every child is asked on every lookup, in order, and the first non-zero answer owns the
request; a ``None`` stops the lookup there and asks again next step; every child hears every
allocation (the owner with its count, the others with 0), every finish and every save; the
start-up handshake call reaches every child, with ``{}`` when no worker has metadata. On a run
of plain children each child receives the same calls, in the same order, as under upstream
(``tests/composite/test_compat_differential.py`` compares them, on the real scheduler and in
a real engine), except for what kvcompose changes on purpose:

- **owner-only receives**: a child's ``update_connector_output`` shows only the receives and
  failures of loads it owns, the sends it delayed, and its own slice of the worker metadata
  and KV events (upstream shows every child the whole output, so a child that counts its
  failures blames itself for another's); on the worker, a ``finished_recving`` from a child
  that does not own the load is dropped and counted as a violation;
- **one terminal signal**: a request's ``finished_sending`` goes up once every child that
  delayed its free has reported, and a request aborted while loading with a delayed free gets
  one signal after both happened (upstream counts sends, but passes receives through);
- **stats keyed by node name**: ``get_kv_connector_stats`` groups the children's stats by
  their name in the tree (two ``ExampleConnector`` children stay apart; upstream merges them
  under the class name) and adds kvcompose's own counters (hits, lookups, violations);
- **worker KV cache events**: ``get_kv_connector_kv_cache_events`` is asked of every child
  and composed per child (upstream does not forward it yet: the TODO citing vllm#31811);
- **the handshake sliced**: with handshake metadata, each child gets its own part (upstream
  hands every child everyone's, which NIXL rejects next to another handshaking child);
- **containment**: a child that raises is handled by its ``on_error`` policy, a failed load
  excludes its child from the request's next lookup, a child answering ``None`` past the
  node's ``lookup_timeout_s`` is skipped, ``(0, True)`` is read as ``(0, False)``, clashing
  ``kv_transfer_params`` keep the first child's value (upstream raises), and a request
  without an owner gets vLLM's default loaded groups (upstream raises ``KeyError``);
- **per-child transfer config**: a child inherits the parent's ``KVTransferConfig`` fields
  it does not set (upstream inherits none), so a child may set its own ``engine_id``.

A kvcompose tree is also accepted here. The class supports HMA like upstream's, and vLLM
decides by upstream's rule (``MultiConnector.all_children_support_hma``: HMA stays on when
every child is ``SupportsHMA``, kvcompose's ``PrefixStoreConnector`` included).
"""

from __future__ import annotations

from kvcompose.composite.node import CompositeConnectorHMA
from kvcompose.connector import ReadsUserConfig


class MultiConnector(ReadsUserConfig, CompositeConnectorHMA):
    """kvcompose's composite under the class name vLLM special-cases."""

    ask_every_child = True


__all__ = ["MultiConnector"]
