"""Analysis and capacity planning for specload results, in four rooms along the data flow.

- ``analysis.data``: loading a run (requests.parquet, steps.parquet, manifest.json:
  ``load``), SLOs (``slo``), per-cell metrics (``metrics``: throughput, speedup,
  latency, goodput, acceptance) and the per-run digests (``faults``, ``memory``,
  ``stability``, ``consistency``, ``degradation``, ``cost_curve_file``); ``analysis``
  holds everything the renderers need.
- ``analysis.model``: the capacity model: batch capacity and wasted verification
  (``capacity``), the one step cost model per strategy (``stepcost``), its backtest
  (``backtest``: calibrated per output class, predicted throughput / TPOT / crossover)
  and the queue per replica (``replica_model``).
- ``analysis.decide``: what a team acts on: the recommendation per tier x output class
  with bootstrap confidence (``recommend``), model checks (``checks``), the report's
  questions (``questions``), the capacity plan (``plan``, ``serve_plan``) and its
  validation by a real run (``validate``).
- ``analysis.report``: figures (``plots``, ``capacity_plots``, ``capacity_section``),
  report.md / report.html / recommendation.json (``build``, ``render``).

Entry points: ``analysis.report.build.build_report`` and ``analysis.decide.plan.plan``;
CLI ``python -m analysis report|plan|backtest`` (``analysis.cli``).
"""
