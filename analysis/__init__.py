"""Analysis and capacity planning for specload results: four rooms along the data flow, and the campaigns.

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
  questions (``questions``), the capacity plan (``plan``, ``serve_plan``) and what a
  validation run is worth (``validate``, ``policy_validate``).
- ``analysis.report``: figures (``plots``, ``capacity_plots``, ``capacity_section``),
  report.md / report.html / recommendation.json (``build``, ``render``).

- ``analysis.campaigns``: on top of the load generator, what starts the service and drives
  load to validate a plan or a policy (``plan_validation``, ``policy_validation``).

Entry points: ``analysis.report.build.build_report`` and ``analysis.decide.plan.plan``;
CLI ``python -m analysis report|plan|backtest|surface|policy`` (``analysis.cli``). The
library rooms sit below ``loadgen`` (which builds the report after a run); the campaigns
and the commands sit above it (``tests/test_layers.py``).
"""
