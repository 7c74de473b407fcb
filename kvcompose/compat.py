"""A drop-in for vLLM's ``MultiConnector``.

vLLM special-cases the literal connector name ``MultiConnector`` (NIXL config fix-ups, HMA
support through ``MultiConnector.all_children_support_hma``, SimpleCPUOffload discovery), one
level deep. Exporting the composite under that name keeps those checks working: an existing
MultiConnector user switches by adding one line to the same JSON::

    {"kv_connector": "MultiConnector", "kv_connector_module_path": "kvcompose.compat",
     "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [...]}}

The ``connectors`` list means what it means upstream — a chain, first hit in order, every
child saves — with kvcompose's fixes (owner-only receive signals, counted sends, every child
told of every allocation, stats per node, per-child ``engine_id``). A kvcompose tree is also
accepted here. The class supports HMA like upstream's; vLLM checks the children.
"""

from __future__ import annotations

from kvcompose.composite.node import CompositeConnectorHMA
from kvcompose.connector import ReadsUserConfig


class MultiConnector(ReadsUserConfig, CompositeConnectorHMA):
    """kvcompose's composite under the class name vLLM special-cases."""


__all__ = ["MultiConnector"]
