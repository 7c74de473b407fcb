"""The scheduler-overhead microbenchmark: what composing connectors costs vLLM's scheduler.

Run by ``benchmarks/scheduler_overhead.py`` (which puts ``benchmarks/`` on ``sys.path``, so
this package imports as ``overhead``): ``measure`` drives the configurations through the
scheduler harness, ``floor`` is the barest composite they are compared with, ``results`` is
``overhead.json``'s form and ``report`` prints it. Benchmark code, not part of the
``kvcompose`` package.
"""
