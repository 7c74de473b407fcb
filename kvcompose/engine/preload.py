"""What the server of preloaded engine processes imports once (``EngineProcess(preloaded=True)``).

Importing vLLM (and torch, transformers) takes about 10 s on 2 cores, most of an engine's
start. A run that starts many engines one after another (``kvcompose bench``: one per
contender and round) pays it once: its engine processes fork from a ``forkserver`` that
imported this module, and start with vLLM already loaded (vLLM forks its own workers from a
process that imported it the same way).

Only imports happen here: no engine, no torch thread pool, nothing a fork could break. What
is read at import time is set first (``ENGINE_ENV``: OpenMP reads ``OMP_WAIT_POLICY`` when
it is loaded); the per-engine environment is applied in each child after the fork, before
its engine is built (vLLM reads its settings when the engine starts), and the child sets
vLLM's log level from it again (``kvcompose.engine.process``). The import's warnings are
not shown (the children's logs have their own).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from kvcompose.engine.llm import engine_env

#: Modules an engine needs before its first step, imported here once: the entry points, then
#: what building a CPU engine of the bench's (Llama) model imports (about 2 s more).
MODULES = (
    "vllm",
    "vllm.config",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.metrics.reader",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.layers.quantization.compressed_tensors.utils",
)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """stdout and stderr (file descriptors 1 and 2) to /dev/null, restored afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (null, *saved):
            os.close(fd)


def preload() -> None:
    """Import ``MODULES``; one that fails is left to the children (they import what they
    need)."""
    engine_env()
    import importlib

    with _quiet():
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception:
                continue


preload()
