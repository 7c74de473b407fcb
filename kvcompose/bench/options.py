"""What a ``kvcompose bench`` run is asked to do: ``BenchOptions`` and ``EngineOptions``.

Fields declared with ``opt`` are also the command-line flags (``kvcompose.bench.flags``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvcompose.bench.flags import opt
from kvcompose.bench.traces import MooncakeParams
from kvcompose.bench.workloads import ChatParams, DocQAParams, NoReuseParams

#: ``vllm.LLM``'s dtype names.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass
class EngineOptions:
    """What every compared engine is started with (``vllm.LLM`` keywords)."""

    max_model_len: int = opt(4096, "longest prompt plus output", minimum=1)
    max_num_seqs: int = opt(8, "requests in one engine step", minimum=1)
    max_num_batched_tokens: int = opt(2048, "tokens in one engine step", minimum=1)
    #: vLLM's own (local) prefix cache. Off by default: every reused token then comes from a
    #: tier, so contenders differ only in their connectors. On, it serves repeats within a run.
    enable_prefix_caching: bool = opt(
        False,
        "vLLM's local prefix cache (default off: every reused token then comes from a tier)",
        flags=("--prefix-caching",),
    )
    dtype: str = opt("float32", "model dtype", choices=DTYPES)
    block_size: int | None = opt(
        None, "KV cache block size (default: the platform's, 128 on CPU)", minimum=1
    )  # None: the platform default
    #: The KV cache's memory; None: the engines' 1 GiB (``VLLM_CPU_KVCACHE_SPACE``).
    kv_cache_mib: int | None = opt(
        None, "KV cache memory in MiB (default: 1 GiB)", minimum=1, metavar="MIB"
    )
    extra: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM keyword

    def llm_kwargs(self, seed: int) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "dtype": self.dtype,
            "enforce_eager": True,
            "seed": seed,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
        }
        if self.block_size:
            kw["block_size"] = self.block_size
        if self.kv_cache_mib:
            kw["kv_cache_memory_bytes"] = self.kv_cache_mib * 2**20
        kw.update(self.extra)
        return kw

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchOptions:
    workload: str = opt(
        "chat",
        "chat (default), docqa, noreuse, a JSONL trace, or mooncake:FILE",
        flags=("--workload", "-w"),
        metavar="W",
        group="compare",
    )
    contenders: list[str] = field(default_factory=list)  # empty: the default comparison
    model: str = "builtin"  # builtin | tiny | a model directory
    engine: EngineOptions = field(default_factory=EngineOptions)
    seeds: list[int] = opt(  # noqa: RUF009 (opt makes a dataclass field)
        factory=lambda: [0],
        help="comma-separated seeds; each seed builds "
        "its own workload contents and runs every contender (default 0)",
        group="engine",
    )
    out_dir: str = opt("kvcompose-bench", "output directory", flags=("--out", "-o"))
    #: Each contender runs once per round; the order rotates from round to round (A B C, then
    #: B C A...), so that a slow spell of a shared machine does not land on one contender.
    repeats: int = opt(
        3,
        "rounds per seed: every contender runs once per round, the order rotated; ratios to "
        "recompute are taken within a round (default 3)",
        group="compare",
        minimum=1,
    )
    chat: ChatParams = field(default_factory=ChatParams)
    docqa: DocQAParams = field(default_factory=DocQAParams)
    noreuse: NoReuseParams = field(default_factory=NoReuseParams)
    mooncake: MooncakeParams = field(default_factory=MooncakeParams)
    trace_limit: int | None = opt(
        None, "traces: replay at most this many requests", group="workload", minimum=1
    )
    max_tokens: int | None = opt(
        None,
        "output tokens per request (default: the workload's, 16)",
        group="workload",
        minimum=1,
    )
    time_scale: float = opt(
        1.0, "multiply every arrival offset (0: all requests at once)", group="workload"
    )
    warmup_requests: int = opt(
        2, "warm-up requests per engine (unrelated prompts; default 2)", flags=("--warmup",)
    )
    prefill: bool = opt(
        True, "fill the stores with the workload's prepared contents (no: every store starts empty)"
    )
    keep_stores: bool = opt(False, "keep store directories")
    store_root: str | None = opt(
        None, "where disk stores go (default: OUT/stores)", flags=("--store-dir",)
    )
    tmpfs_root: str | None = opt(
        None, "where tmpfs stores go (default /dev/shm)", flags=("--tmpfs-dir",)
    )
    contender_timeout_s: float = opt(
        1800.0,
        "seconds before a contender's engine is given up (default 1800)",
        flags=("--contender-timeout", "--chain-timeout"),
        minimum=1,
    )
    plots: bool = opt(True, "write the PNG plots")
    progress: bool = opt(True, "show progress")
