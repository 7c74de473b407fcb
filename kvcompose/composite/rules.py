"""Aggregation rules: what a composite does with each member of vLLM's connector API.

This table is the single statement of the rules. ``CompositeConnector`` implements each
member once according to its rule (in its scheduler or worker half, or itself for both sides
and class-level members); ``tests/composite/test_rules.py`` fails when vLLM's
``KVConnectorBase_V1`` or ``SupportsHMA`` gains a public member that is missing here or not
implemented by the composite, and ``docs/concepts.md`` carries the same table (kept in sync by
a test).
"""

from __future__ import annotations

import enum


class Aggregation(enum.Enum):
    """How a composite combines its children for one member (not a route ``RouteRule``)."""

    ALL = "all"  # call every child, nothing returned
    ALL_SAVERS = "all savers"  # call every child whose save flag is set
    ANY = "any"  # true if any child is true
    EVERY = "every"  # true only if every child is true
    OWNER = "owner"  # only the request's load owner (fallback: the base default)
    POLICY = "policy"  # the node's lookup policy picks one owner
    OWNER_N_OTHERS_0 = "owner n, others 0"  # every child, owner with n, the rest with 0
    PER_CHILD_SLICE = "per-child slice"  # each child gets its own part of a composite object
    COMPOSED = "composed"  # each child's result wrapped in one composite object
    CHAINED = "chained"  # results concatenated in child order
    UNION_OWNER_FILTERED = "owner-filtered union"  # receives from the owner, sends counted
    UNION = "union"
    COUNTED = "counted"  # every child called; finish reported once all delaying children end
    MUST_AGREE = "must agree"  # all children equal (None = no preference) or a start-up error
    AT_MOST_ONE = "at most one"  # at most one child may return a value
    TRISTATE = "tri-state"  # False if any False; True if all True; else None
    KEYED_BY_NODE = "keyed by node name"
    OWN = "own"  # the composite's own state (base behaviour, also forwarded where noted)
    PRIVATE = "not forwarded"  # base-class internals


RULES: dict[str, tuple[Aggregation, str]] = {
    # --- identity / metadata plumbing
    "role": (Aggregation.OWN, "the role the composite was built with; children share it"),
    "bind_connector_metadata": (
        Aggregation.PER_CHILD_SLICE,
        "binds each child's slice and the composite's own metadata",
    ),
    "clear_connector_metadata": (Aggregation.ALL, "clears every child and the composite"),
    "has_connector_metadata": (Aggregation.OWN, "true while the composite metadata is bound"),
    # --- scheduler side: lookup and allocation
    "get_num_new_matched_tokens": (
        Aggregation.POLICY,
        "first / longest / route / fan-out picks "
        "one owner; its (n, async) goes up unchanged; "
        "stitch asks each able child where the earlier ones end and reports the total, "
        "async if any segment is; (0, True) → (0, False); on several KV cache groups a "
        "sync load goes up as async (parked: its failure can then be reported by request); "
        "a child asked about every request (LMCacheMPConnector), or a node holding one, is "
        "asked whatever the plan and told 0 where the plan does not take its hit",
    ),
    "update_state_after_alloc": (
        Aggregation.OWNER_N_OTHERS_0,
        "every child with the real blocks: the owner with the scheduler's count, the others "
        "with 0; a stitch cuts its segments to the grant and tells each segment's child its "
        "count (a last-segment child through a block view from its start)",
    ),
    "get_external_cache_hit_sources": (
        Aggregation.OWNER,
        "the owner splits its tokens by tier; a stitch sums each segment child's split",
    ),
    "get_loaded_kv_cache_group_ids": (
        Aggregation.OWNER,
        "the owner's groups (a stitch: the groups every segment's child restores); "
        "base default when no owner",
    ),
    "build_connector_meta": (
        Aggregation.COMPOSED,
        "every child every step; plus new async loads "
        "(owner per request), stitched loads (awaited children, segment blocks) and "
        "expected finished-sending children",
    ),
    "update_connector_output": (
        Aggregation.PER_CHILD_SLICE,
        "each child sees the output with its own "
        "worker-metadata and KV-event slices; the ledger records loads (each async segment's "
        "child sees its own receive, failed if its segment failed)",
    ),
    "request_finished": (
        Aggregation.COUNTED,
        "every child; delay if any child delays; params merged, a key clash names both children",
    ),
    "request_finished_all_groups": (
        Aggregation.COUNTED,
        "as request_finished; HMA children get all "
        "groups, the others request_finished(block_ids[0])",
    ),
    "register_finished_partial_tail": (
        Aggregation.COUNTED,
        "every child; accepting children are counted like delaying ones",
    ),
    "on_new_request": (Aggregation.ALL, "every child"),
    "take_events": (Aggregation.CHAINED, "children's events in child order"),
    "has_pending_block_frees": (Aggregation.ANY, "any child"),
    "has_pending_push_work": (Aggregation.ANY, "any child"),
    "bind_kv_cache_manager": (Aggregation.ALL, "every child (each binds its block pool itself)"),
    "bind_gpu_block_pool": (Aggregation.ALL, "every child"),
    "get_finished_count": (
        Aggregation.MUST_AGREE,
        "None means world size; different counts refuse to start (vLLM asks at engine start)",
    ),
    "reset_cache": (Aggregation.TRISTATE, "False if any child False; True if all True; else None"),
    "set_xfer_handshake_metadata": (
        Aggregation.PER_CHILD_SLICE,
        "every child its own handshake part ({} when it has none)",
    ),
    "set_xfer_handshake_metadata_pp_aware": (
        Aggregation.PER_CHILD_SLICE,
        "every child its own handshake part ({} when it has none)",
    ),
    "supports_divergent_local_hybrid_hits": (Aggregation.EVERY, "every child"),
    "requires_kv_delivery": (Aggregation.ANY, "any child"),
    # --- worker side
    "get_mem_pool_context": (Aggregation.AT_MOST_ONE, "at most one child may supply a memory pool"),
    "register_kv_caches": (Aggregation.ALL, "every child, same tensors"),
    "set_host_xfer_buffer_ops": (Aggregation.ALL, "every child"),
    "unregister_kv_caches": (Aggregation.ALL, "every child (vLLM ≥ 0.33)"),
    "restore_kv_caches": (Aggregation.ALL, "every child (vLLM ≥ 0.33)"),
    "finish_forward": (Aggregation.ALL, "every child (V2 model runner)"),
    "reset_capture_state": (Aggregation.ALL, "every child (V2 model runner)"),
    "handle_preemptions": (Aggregation.PER_CHILD_SLICE, "each child its own metadata slice"),
    "start_load_kv": (Aggregation.ALL, "every child; keyword arguments forwarded"),
    "wait_for_layer_load": (Aggregation.ALL, "every child"),
    "save_kv_layer": (Aggregation.ALL_SAVERS, "children with save: true"),
    "wait_for_save": (Aggregation.ALL_SAVERS, "children with save: true"),
    "get_finished": (Aggregation.UNION_OWNER_FILTERED, "derived from get_transfer_results"),
    "get_transfer_results": (
        Aggregation.UNION_OWNER_FILTERED,
        "receives and failures only from the "
        "load owner, once (a stitch: one receive once every async segment reported); "
        "a send once every delaying child finished",
    ),
    "get_block_ids_with_load_errors": (Aggregation.UNION, "union of the children"),
    "get_kv_connector_stats": (
        Aggregation.KEYED_BY_NODE,
        "children's stats under their node names, plus the composite's own counters",
    ),
    "get_kv_connector_kv_cache_events": (
        Aggregation.COMPOSED,
        "each child's events tagged by child",
    ),
    "get_handshake_metadata": (Aggregation.COMPOSED, "each child's handshake part"),
    "build_connector_worker_meta": (
        Aggregation.COMPOSED,
        "each child's worker metadata, plus the children whose stitch segments failed",
    ),
    "shutdown": (Aggregation.ALL, "every child, even if one raises; the first error re-raised"),
    # --- class level
    "get_required_kvcache_layout": (
        Aggregation.MUST_AGREE,
        "children's layouts; a conflict is an error",
    ),
    "requires_piecewise_for_cudagraph": (Aggregation.ANY, "any child"),
    "build_kv_connector_stats": (
        Aggregation.KEYED_BY_NODE,
        "rebuilt by class path, no registry lookup",
    ),
    "build_prom_metrics": (
        Aggregation.KEYED_BY_NODE,
        "one metric set per child class, samples labelled by node",
    ),
    "supports_sleep_mode": (Aggregation.EVERY, "every child (vLLM ≥ 0.33)"),
    # --- base internals
    "_get_connector_metadata": (Aggregation.PRIVATE, "the composite's own bound metadata"),
}


def public_members(cls: type) -> set[str]:
    """Public members a class declares or inherits, excluding ``object``'s."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(n for n in vars(klass) if not n.startswith("_"))
    return names


def markdown_table() -> str:
    """The rule table as Markdown, for the docs (``python -m kvcompose.composite.rules``)."""
    rows = ["| member | rule | what the composite does |", "|---|---|---|"]
    rows += [f"| `{name}` | {rule.value} | {what} |" for name, (rule, what) in RULES.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
