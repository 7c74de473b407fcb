"""Real vLLM engines for the bench and the tests, in one place.

- ``kvcompose.engine.model``: models built locally (the tiny test model, the benchmark model);
- ``kvcompose.engine.llm``: the engine environment, ``make_llm`` (a single-process
  ``vllm.LLM``, torn down on exit) and ``greedy``;
- ``kvcompose.engine.process``: ``EngineProcess``, an engine in a child process;
- ``kvcompose.engine.probe``: the engine core, scheduler and connector trees of a running
  engine;
- ``kvcompose.engine.nixl_poll``: NIXL's progress thread pausing between polls, for the
  test beds' engines on a few CPU cores;
- ``kvcompose.engine.harness``: ``SchedulerHarness``, vLLM's real scheduler without a model
  (``AsyncSchedulerHarness``: under async scheduling); ``harness_worker``: its worker half.

Importing this package does not import vLLM.
"""
