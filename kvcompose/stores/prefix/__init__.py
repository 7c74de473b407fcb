"""A prefix-aware disk (or tmpfs) KV store, usable as a vLLM v1 KV connector.

vLLM's ``ExampleConnector`` hashes a whole prompt, so a prompt that merely *extends* a
stored one (a growing chat history) finds nothing. This store splits every prompt into
chunks of ``chunk_blocks`` vLLM blocks and keys each chunk by a chained hash
(:mod:`~kvcompose.stores.prefix.keys`), so two prompts that share their first ``k`` chunks
share ``k`` files, and a lookup counts the stored chunks from the start of the prompt.

Load it with::

    KVTransferConfig(
        kv_connector="PrefixStoreConnector",
        kv_connector_module_path="kvcompose.stores",
        kv_role="kv_both",
        kv_connector_extra_config={"path": "/dev/shm/kv", "load_mode": "sync"},
    )

``kv_connector_extra_config`` keys (see :class:`PrefixStoreConfig`):

``path`` (str, required)
    Directory of the store; created if missing. One ``<key>.safetensors`` file per chunk,
    holding every attention layer's KV for the chunk's tokens (one tensor per layer, named
    by the layer).
``load_mode`` ("sync" | "async", default "sync")
    ``sync``: the load is done in ``start_load_kv`` before the forward of the step that
    schedules the request. ``async``: the request waits in ``WAITING_FOR_REMOTE_KVS``; the
    worker loads it in ``start_load_kv`` of the step whose metadata carries the load and
    reports it in ``finished_recving`` of that same step.
``chunk_blocks`` (int >= 1, default 1)
    Chunk size in vLLM blocks.
``max_chunks`` (int >= 1, optional)
    Cap on the number of chunk files; after each write the least recently written/loaded
    files are deleted. Files are written and touched in reverse prefix order so a chain's
    first chunks are evicted last.
``read_only`` (bool, default false)
    Never save (nor touch or evict files); only load.
``namespace`` (str, optional)
    Replaces the model name in the hash salt (default: model path, dtype, KV-cache dtype,
    block size, chunk size), e.g. to share a store between two copies of the same model
    directory.
``save_mode`` ("sync" | "background", default "sync"), ``max_pending_saves`` (default 64)
    Write in ``wait_for_save`` (in the engine step), or queue for a writer thread that
    holds the request's blocks (delayed free) until written and drops saves past
    ``max_pending_saves`` queued chunks.
``max_bytes`` (int >= 1, optional)
    Cap on the bytes of chunk files, evicted like ``max_chunks``.
``admit_min_prompt_tokens`` (default 0), ``admit_min_seen`` (default 1), ``admit_when``,
``promote``
    Admission: save only prompts this long, only chunks this many requests carried, only
    requests meeting ``admit_when`` (a route rule's conditions); ``promote: true`` saves
    chunks another tier loaded whatever the rule.
``medium`` ("cpu" | "tmpfs" | "disk" | "remote", default: from the mount)
    The vLLM hit source and the KV cache events' medium.
``emulate_read`` (``{latency_ms, gbps}``, optional; benchmarks only)
    An emulated slow tier: every load takes at least ``latency_ms`` plus its bytes at
    ``gbps`` GB/s (the store sleeps after the real read; counted as ``emulated_wait_s``).

The hierarchy keys are described in ``docs/stores.md``.

Fault injection for tests (``fail_load_request_ids``) lives in a test double,
``FaultyPrefixStoreConnector`` in :mod:`kvcompose.testing.faulty_store`.

What a file holds: for every attention layer, the request's whole KV-cache blocks for the
chunk, copied as they are (``kv_cache[block_ids]``, blocks at dim 0), so a round trip is
exact whatever the backend packs inside a block. Loads therefore always move whole blocks;
vLLM's local prefix hit is block-aligned, and the block size is part of the hash salt.

Lookups count only chunks inside ``prompt[:-1]`` and return ``(0, False)`` rather than
``(0, True)``. Only prompt tokens are saved, once their chunk is fully computed (chunked
prefill included); a chunk already on disk is not rewritten. Requests with multimodal
inputs or prompt embeddings are neither looked up nor saved (their KV is not determined by
the token ids). The LoRA name and the request's ``cache_salt`` are part of the hash. With
``save_mode: sync`` saves are written in ``wait_for_save`` and ``request_finished`` never
delays freeing; with ``background`` it returns ``True`` for a request with saves planned
and the worker reports it in ``finished_sending`` once they are written.

Limits: models with one KV cache group only (refused otherwise); with tensor or pipeline
parallelism each worker writes its own file per chunk (``<key>.pp<p>tp<t>.safetensors``)
and a chunk counts as stored when all exist (untested: the test machines have one CPU
worker); ``max_chunks`` eviction runs in the worker after writes, without coordination
between several engines sharing a directory.

Modules, one role each: ``keys`` (chunk hashing), ``config`` (the extra config),
``files`` (directory layout, I/O, eviction), ``safetensors_io`` (the file format, written
and its header read without the library's copies), ``metadata`` (what a step carries from
scheduler to workers), ``stats`` and ``prom`` (counters, Prometheus), ``admission``
(admission rule, frequency sketch), ``tier`` (medium, hit source, KV events), ``writer``
(the background writer), ``scheduler`` and ``worker`` (the two halves; the worker's
``loads`` copy chunks into the KV cache, its ``saves`` write them), ``connector`` (the vLLM
class, delegating by role).
"""

from importlib import import_module
from typing import Any

from kvcompose.stores.prefix.config import PrefixStoreConfig

# Everything else imports vLLM and torch: loaded on first use (PEP 562), so that reading or
# checking a store's config (``kvcompose validate``) stays as quick as the config layer.
_LAZY = {
    "PrefixStoreConnector": "connector",
    "chunk_file_name": "files",
    "store_usage": "files",
    "chunk_keys": "keys",
    "lookup_limit_chunks": "keys",
    "ChunkLoad": "metadata",
    "LoadSpec": "metadata",
    "PrefixStoreMetadata": "metadata",
    "SaveSpec": "metadata",
    "PrefixStoreStats": "stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ChunkLoad",
    "LoadSpec",
    "PrefixStoreConfig",
    "PrefixStoreConnector",
    "PrefixStoreMetadata",
    "PrefixStoreStats",
    "SaveSpec",
    "chunk_file_name",
    "chunk_keys",
    "lookup_limit_chunks",
    "store_usage",
]
