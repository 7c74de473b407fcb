"""``kvcompose bench``: compare KV connector setups ("contenders") on a real vLLM engine.

``run_bench(BenchOptions(...))`` runs one workload (``kvcompose.bench.workloads``) against
several contenders (``kvcompose.bench.contenders``: no connector, a vLLM connector config, a
kvcompose config...), each in a fresh engine in its own process (``kvcompose.engine``), and
writes results JSON/CSV and plots (``kvcompose.bench.report``). The CLI is
``kvcompose bench`` (``kvcompose.cli.bench_cmd``), also runnable as ``python -m
kvcompose.bench``.

Importing this package does not import vLLM.
"""

from __future__ import annotations

from typing import Any

_LAZY = {"BenchOptions": "kvcompose.bench.options", "run_bench": "kvcompose.bench.run"}

__all__ = ["BenchOptions", "run_bench"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcompose.bench' has no attribute {name!r}")
