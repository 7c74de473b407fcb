"""The engine configuration and the KV cache configuration ``EngineCore`` would build,
made without a model.

``SchedulerHarness`` needs vLLM's real ``KVCacheConfig`` (block counts, layout, hash block
size) to build a real ``Scheduler``; these follow ``EngineCore._initialize_kv_caches`` with
per-layer attention specs taken from the model config, on vLLM 0.32 and 0.33.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_kv_cache_configs(
    vllm_config: Any, num_blocks: int, sliding_window: int | None = None
) -> tuple[Any, Any, int, int]:
    """What EngineCore._initialize_kv_caches does, with per-layer specs made from the model
    config instead of a model: returns (worker config, scheduler config, scheduler block
    size, hash block size).

    The layers the model's config marks ``sliding_attention`` (``layer_types``, as vLLM's
    Llama reads it) get a ``SlidingWindowSpec`` over its ``sliding_window``; with
    ``sliding_window`` given, the even layers slide over that many tokens whatever the model
    says. With the hybrid KV cache manager on, vLLM then forms a sliding-window group and a
    full-attention group; with it off, ``get_kv_cache_configs`` makes the sliding layers full
    attention (one group), as for a real hybrid model."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    shape = {
        "block_size": cache_config.block_size,
        "num_kv_heads": model_config.get_num_kv_heads(parallel_config),
        "head_size": model_config.get_head_size(),
        "dtype": model_config.dtype,
    }
    spec = FullAttentionSpec(**shape)
    num_layers = model_config.get_num_layers(parallel_config)
    sliding = _sliding_layers(model_config.hf_text_config, num_layers, sliding_window)
    specs = {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(**shape, sliding_window=sliding[i]) if i in sliding else spec
        )
        for i in range(num_layers)
    }
    # As EngineCore: resolve one KV cache layout from what the attention backends support.
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    layouts = [
        layout.name
        for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
    ]
    resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))

    # num_gpu_blocks_override fixes the count; the memory only has to be large enough (twice
    # the full-attention need: vLLM's check for a hybrid layout counts more than that).
    memory = (num_blocks + 1) * spec.page_size_bytes * num_layers * (2 if sliding else 1)

    try:  # vLLM 0.33: planning split out of kv_cache_utils, groups computed first
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs as _configs

        groups = get_global_kv_cache_groups(vllm_config, [specs])
        adjust = getattr(vllm_config, "adjust_dcp_kv_cache_interleave_size", None)
        if adjust is not None:
            adjust(groups)
        worker_configs = _configs(vllm_config, [specs], [memory], groups)
    except ImportError:  # vLLM 0.32
        worker_configs = kcu.get_kv_cache_configs(vllm_config, [specs], [memory])

    sched_config = kcu.generate_scheduler_kv_cache_config(worker_configs)
    cache_config.num_gpu_blocks = sched_config.num_blocks
    sched_block_size, hash_block_size = kcu.resolve_kv_cache_block_sizes(sched_config, vllm_config)
    resolve_align = getattr(kcu, "resolve_cache_hit_alignment_tokens", None)
    align = (
        resolve_align(sched_config, vllm_config, sched_block_size, hash_block_size)
        if resolve_align is not None
        else None
    )
    for cfg in (*worker_configs, sched_config):
        cfg.kv_cache_layout = cache_config.kv_cache_layout
        if hasattr(cfg, "hash_block_size"):
            cfg.hash_block_size = hash_block_size
        if align is not None and hasattr(cfg, "cache_hit_alignment_tokens"):
            cfg.cache_hit_alignment_tokens = align
    return worker_configs[0], sched_config, sched_block_size, hash_block_size


def _sliding_layers(hf_config: Any, num_layers: int, sliding_window: int | None) -> dict[int, int]:
    """Layer index -> window, for the layers that slide (see ``make_kv_cache_configs``)."""
    if sliding_window is not None:
        return {i: sliding_window for i in range(0, num_layers, 2)}
    window = getattr(hf_config, "sliding_window", None)
    kinds = getattr(hf_config, "layer_types", None) or ()
    if not window:
        return {}
    return {i: window for i, kind in enumerate(kinds[:num_layers]) if kind == "sliding_attention"}


def make_vllm_config(
    model_dir: Path,
    kv_transfer_config: dict[str, Any] | None,
    *,
    kv_load_failure_policy: str | None,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool,
) -> Any:
    """The ``VllmConfig`` of a tokenizer-less, eager, float32 engine over ``model_dir`` with
    a pool of ``num_blocks`` (``kv_role`` defaults to ``kv_both``)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ktc = None
    if kv_transfer_config is not None:
        cfg = dict(kv_transfer_config)
        cfg.setdefault("kv_role", "kv_both")
        if kv_load_failure_policy is not None:
            cfg["kv_load_failure_policy"] = kv_load_failure_policy
        ktc = KVTransferConfig(**cfg)
    elif kv_load_failure_policy is not None:
        raise ValueError("kv_load_failure_policy needs a kv_transfer_config")
    # vLLM refuses a cache that cannot hold one max_model_len request (the null block
    # aside); with a small pool, shrink max_model_len as a user would have to.
    max_model_len = min(max_model_len, (num_blocks - 1) * block_size)
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        num_gpu_blocks_override=num_blocks,
        kv_transfer_config=ktc,
    )
    return args.create_engine_config()
