"""Benchmarks: each module measures one thing and is its own command, ``python -m bench.<name>``.

Ratios measured side by side in one run, medians of repeats (the machines are shared), never
a threshold inside a unit test.

- ``engine_speedup``: the engine's output tokens/s against ``transformers`` ``generate()`` and
  each strategy against ``autoregressive``; the trade-off table per batch.
- ``acceptance``: position-by-position acceptance, acceptance length (tau), top-k coverage and
  draft cost of every strategy on held-out prompts.
- ``step_cost``: the step-cost grid of real model sizes with random weights (``--shape``), or
  the engine's own profile (``--engine``): what ``analysis plan --cost-curve`` reads.
- ``step_cost_embedded``: the embedded checkpoints' step-cost curve and drafter costs.
- ``device_check``: the prepared one-command check for a GPU loan (engine per strategy and
  dtype, step-cost grid), ``--tiny`` on a CPU.
- ``serving_overhead``: tokens/s through HTTP + Ray Serve against the engine alone.
- ``vs_vllm``: specload next to a real vLLM, engine alone and served (``closed_loop_worker``
  is its per-engine worker process).
- ``loadgen_timing``: the load generator's client-side timing error against a fake server.
- ``loadgen_scale``: scale limits of the load generator and of the results files.

Layer: on top (``tests/test_layers.py``): a benchmark may use any layer below, nothing
imports a benchmark.
"""
