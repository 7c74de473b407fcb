"""``kvcompose bench``: compare connector chains on a real vLLM engine.

``run_bench(BenchOptions(...))`` runs one workload (``kvcompose.bench.workloads``) against
several chains (``kvcompose.bench.chains``), each in a fresh single-process engine in its own
subprocess (``kvcompose.bench.runner``), and writes results JSON/CSV and plots
(``kvcompose.bench.report``). ``kvcompose.bench.overhead`` measures the scheduler-side cost
of composing connectors on vLLM's real scheduler. The CLI is ``kvcompose bench``
(``kvcompose.cli.bench_cmd``), also runnable as ``python -m kvcompose.bench``.

Importing this package does not import vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BenchOptions", "run_bench"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvcompose.bench import core

        return getattr(core, name)
    raise AttributeError(f"module 'kvcompose.bench' has no attribute {name!r}")
