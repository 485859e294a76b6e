"""Analysis and capacity planning for specload results.

Data flow: ``load`` (requests.parquet, steps.parquet, manifest.json) ->
``metrics`` (per-cell throughput, speedup, latency, goodput, acceptance) ->
``capacity`` (batch capacity, wasted verification) and ``stepcost`` (the one
step cost model, per strategy) -> ``backtest`` (calibrated per output class:
predicted throughput, TPOT, crossover) -> ``recommend`` (per tier x output class,
bootstrap confidence) -> ``report`` / ``render`` / ``plots`` (report.md,
report.html, recommendation.json); ``plan`` (replicas per strategy from the step
cost model and a queue per replica, ``replica_model``, or on a modelled GPU);
``degradation`` (baseline check).

Entry points: ``analysis.report.build_report`` and ``analysis.plan.plan``;
CLI ``python -m analysis report|plan``.
"""
