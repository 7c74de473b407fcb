"""Chunk keys: how a prompt maps to the names of the files that hold its KV.

A prompt is cut into chunks of ``chunk_tokens`` tokens and each full chunk is keyed by a
chained hash::

    key_0 = H(root(salt) | tokens[0:C])
    key_i = H(key_{i-1} | tokens[i*C:(i+1)*C])

Chaining makes a key stand for the whole prefix up to the end of its chunk, not just the
chunk's own tokens, so two prompts share the keys of exactly the chunks of their common
prefix, and a lookup can stop at the first key that is not stored. The salt separates
everything that changes the KV of the same tokens (model, dtypes, block and chunk size,
LoRA, the request's ``cache_salt``). Pure functions, no vLLM state: the scheduler half and
tests compute the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: 128-bit keys (32 hex characters): collisions are negligible for any store size.
KEY_BYTES = 16


def root_digest(salt: str) -> bytes:
    """The chain's starting value for a given salt."""
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=KEY_BYTES).digest()


def next_digest(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a chunk from the previous chunk's key and its own token ids.

    Token ids are joined with a separator so that ``[1, 23]`` and ``[12, 3]`` differ.
    """
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
    h.update(b"|")
    h.update(b",".join(str(int(t)).encode("ascii") for t in tokens))
    return h.digest()


def chunk_keys(
    token_ids: Sequence[int],
    chunk_tokens: int,
    salt: str = "",
    max_chunks: int | None = None,
) -> list[str]:
    """Chained hex keys of the *full* chunks of ``token_ids``.

    ``keys[i]`` depends on ``salt`` and on ``token_ids[: (i + 1) * chunk_tokens]`` only, so
    prompts sharing a prefix share the keys of its full chunks. A partial last chunk has no
    key: its KV would change once the prompt grows.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    n = len(token_ids) // chunk_tokens
    if max_chunks is not None:
        n = min(n, max_chunks)
    keys: list[str] = []
    digest = root_digest(salt)
    for i in range(n):
        digest = next_digest(digest, token_ids[i * chunk_tokens : (i + 1) * chunk_tokens])
        keys.append(digest.hex())
    return keys


def lookup_limit_chunks(num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Chunks a lookup may report: those inside ``prompt[:-1]``.

    vLLM must compute at least the last prompt token itself (its logits start decoding), so
    a stored chunk that ends at the prompt's end cannot be offered whole.
    """
    return max(num_prompt_tokens - 1, 0) // chunk_tokens


def store_salt(
    vllm_config: VllmConfig, namespace: str | None, block_size: int, chunk_tokens: int
) -> str:
    """The salt shared by every request of one store instance.

    ``namespace`` replaces the model part (model path and dtype), e.g. to share a store
    between two copies of the same model directory. The KV-cache dtype, block size and
    chunk size are always part of it: files written under other values have another layout.
    """
    if namespace is not None:
        model_part = namespace
    else:
        mc = vllm_config.model_config
        model_part = f"{getattr(mc, 'model', '')}|{getattr(mc, 'dtype', '')}"
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    return f"{model_part}|kv={cache_dtype}|bs={block_size}|chunk={chunk_tokens}"


def request_salt(base: str, request: Any) -> str | None:
    """The salt of one request, or ``None`` when the store must not be used for it.

    Requests with multimodal inputs or prompt embeddings have no usable key: their KV is
    not determined by the token ids. The LoRA adapter and the request's ``cache_salt``
    change the KV of the same tokens, so they extend the salt.
    """
    if request.prompt_token_ids is None or getattr(request, "mm_features", None):
        return None
    salt = base
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        salt += f"|lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}"
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        salt += f"|salt={cache_salt}"
    return salt
