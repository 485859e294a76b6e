"""``python -m analysis plan ... --validate``: prove a capacity plan by running it.

A plan says "N replicas of strategy S serve Q requests/s of this tier's traffic within the
SLOs". The campaign deploys exactly that (a Serve app with S only, ``num_replicas`` N, on a
private Ray head and a free port: ``cluster.launch.deploy_private``), drives open-loop
Poisson arrivals at Q (``python -m loadgen`` with an open-loop tier file:
``analysis.campaigns.drive.run_loadgen``), then repeats with N - 1 replicas. What each run
is worth (SLO attainment, goodput, the arrivals check, the CPU share) is judged by
``analysis.decide.validate``; the module docstring there defines the figures.

``validate_plan`` takes the deploy and load steps as callables so tests can substitute a
fake server.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import yaml

from analysis.campaigns.drive import run_loadgen
from analysis.decide import validate as va
from configs.tiers import Slo

Deploy = Callable[[str, int], tuple[str, Callable[[], None]]]
Drive = Callable[[str, str], Path]


@dataclass(frozen=True)
class _Campaign:
    """What every replica count of one validation shares."""

    choice: va.Choice
    qps: float
    tier: str
    slo: Slo
    duration_s: float
    warmup_s: float
    deploy: Deploy
    drive: Drive
    log: Callable[[str], None]


def default_deploy(acceptance_length: float | None = None, engine_overrides: dict | None = None
                   ) -> Deploy:
    """``deploy(strategy, replicas) -> (url, stop)``: ``va.serve_config`` on a private Ray head
    (``cluster.launch.deploy_private``; its config files go to a fresh temp dir)."""
    from cluster.launch import deploy_private

    work = Path(tempfile.mkdtemp(prefix="specload-validate-"))

    def deploy(strategy: str, replicas: int):
        return deploy_private(va.serve_config(strategy, replicas,
                                              acceptance_length=acceptance_length,
                                              engine=engine_overrides), work)
    return deploy


def default_drive(choice: va.Choice, tier: str, tiers_path: Path, out_dir: Path) -> Drive:
    """``drive(url, run_id) -> run_dir``: the open-loop cell of ``tiers_path`` (profile
    ``validate``) with ``python -m loadgen``, into ``out_dir/run_id``."""
    flags = ["--tier", va.load_tier(tier), "--output", choice.output_class,
             "--strategies", choice.strategy, "--tiers-file", str(tiers_path),
             "--profile", "validate"]

    def drive(url: str, run_id: str) -> Path:
        return run_loadgen(url, flags, out_dir, run_id)
    return drive


def _run_count(c: _Campaign, n: int) -> tuple[pd.DataFrame, Path]:
    """Deploy ``n`` replicas, drive the load, stop; the run's requests (arrivals checked:
    ``va.check_run``) and its directory. Raises RuntimeError when a step fails."""
    url, stop = c.deploy(c.choice.strategy, n)
    try:
        run_dir = c.drive(url, va.run_id_for(c.choice.strategy, n))
    finally:
        stop()
    return pd.read_parquet(Path(run_dir) / "requests.parquet"), Path(run_dir)


def _validate_count(c: _Campaign, result: dict, n: int, key: str) -> None:
    """Measure ``n`` replicas into ``result[key]`` (attainment) and its companions; a count
    below 1 serves nothing (attainment 0), a failed one gets None and its error."""
    count_key = "requests" if key == "attainment" else "requests_minus_one"
    if n < 1:
        result[key], result[count_key] = 0.0, 0
        return
    c.log(f"validate: {c.choice.strategy} x {n} replica(s), {c.qps:g} req/s Poisson for "
          f"{c.duration_s:g} s ({c.tier}/{c.choice.output_class})")
    try:
        req, run_dir = _run_count(c, n)
        result["arrivals"][str(n)] = va.check_run(req, c.qps, c.duration_s)
    except RuntimeError as exc:  # keep what was measured; say why this count has no figure
        result[key], result[count_key] = None, 0
        result.setdefault("errors", {})[str(n)] = str(exc)[-500:]
        c.log(f"validate: {n} replica(s): no figure: {str(exc)[-300:]}")
        return
    att, count, share = va.record_count(result, n, key, req, run_dir, c.slo, c.warmup_s,
                                        c.duration_s)
    c.log(f"validate: {n} replica(s): attainment {att:.1%} over {count} requests"
          + (f"; the replicas' engine threads ran {share:.0%} of their wall time" if share else ""))


def validate_plan(choice: va.Choice, qps: float, tier: str, slo: Slo, target: float,
                  max_tokens, out_dir: Path, duration_s: float = va.DEFAULT_DURATION_S,
                  warmup_s: float = va.DEFAULT_WARMUP_S, deploy: Deploy | None = None,
                  drive: Drive | None = None, log=print,
                  acceptance_length: float | None = None,
                  engine_overrides: dict | None = None) -> dict:
    """Run the plan with N and N - 1 replicas; returns the ``--validate --json`` dict
    (``va.new_result``'s keys, then per count "attainment" / "attainment_minus_one",
    "requests" / "requests_minus_one", "arrivals", "cpu_share", "goodput_tok_s", "runs",
    and "holds", "tight": ``va.verdict``); a replica count that could not be deployed or
    driven (``check_run`` failed) gets attainment None (holds / tight None) and its error
    under "errors".

    ``engine_overrides``: engine fields set on the deployed strategy (``max_num_seqs``,
    ``max_waiting``: the limits the plan was made for).
    ``deploy(strategy, replicas) -> (url, stop)`` and ``drive(url, run_id) -> run_dir``
    default to ``default_deploy`` (``python -m cluster up`` on a private head) and
    ``default_drive`` (``python -m loadgen``)."""
    out_dir = Path(out_dir).resolve()   # the load generator runs with its own cwd
    out_dir.mkdir(parents=True, exist_ok=True)
    tiers_path = out_dir / "validate-tiers.yaml"
    tiers_path.write_text(yaml.safe_dump(va.tiers_file(tier, choice.output_class, qps, duration_s,
                                                       slo, max_tokens)))
    c = _Campaign(choice, qps, tier, slo, duration_s, warmup_s,
                  deploy or default_deploy(acceptance_length, engine_overrides),
                  drive or default_drive(choice, tier, tiers_path, out_dir), log)
    result = va.new_result(choice, qps, tier, slo, target, duration_s, warmup_s, acceptance_length)
    for n, key in ((choice.replicas, "attainment"), (choice.replicas - 1, "attainment_minus_one")):
        _validate_count(c, result, n, key)
    return va.verdict(result, target)
