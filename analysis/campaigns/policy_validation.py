"""``python -m analysis policy RUN --validate``: run the derived policy against the best fixed
strategy at every tier of the run.

The campaign deploys ``analysis.decide.policy_validate.validation_config`` (the policy and
every tier's best fixed deployment, one replica each) on a private Ray head
(``cluster.launch.deploy_private``), drives each tier in turn with ``python -m loadgen``
(``analysis.campaigns.drive.run_loadgen``: closed loop, the run's own profile, every cell
cut to ``duration_s`` seconds) and stops the cluster at the end, whatever happened. What
the figures mean, and how a tier's rows are built, is ``analysis.decide.policy_validate``.

``deploy(config) -> (url, stop)`` and ``drive(url, tier, strategies, run_id) -> run_dir``
can be substituted (tests use a fake server). A tier whose load run fails gets no figure
and its error under ``errors`` (the other tiers go on).
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import yaml

from analysis.campaigns.drive import run_loadgen
from analysis.decide import policy_validate as pv
from configs.tiers import Slo


def _write_inputs(out_dir: Path, manifest: dict | None, cfg: dict) -> tuple[Path | None, str | None]:
    """Write the Serve config deployed (``policy-validate-serve.yaml``) and, when the run's
    profile replays (``pv.tiers_file``), its tier file; returns (tier file or None, profile)."""
    doc, profile = pv.tiers_file(manifest)
    tiers_path = None
    if doc is not None:
        tiers_path = out_dir / "policy-validate-tiers.yaml"
        tiers_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    (out_dir / "policy-validate-serve.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return tiers_path, profile


def default_deploy() -> Callable:
    """``deploy(config) -> (url, stop)``: ``cluster.launch.deploy_private`` (temp work dir)."""
    from cluster.launch import deploy_private

    work = Path(tempfile.mkdtemp(prefix="specload-policy-"))
    return lambda config: deploy_private(config, work)


def default_drive(output: str, tiers_path: Path | None, profile: str | None,
                  duration_s: float, out_dir: Path) -> Callable:
    """``drive(url, tier, strategies, run_id) -> run_dir``: ``python -m loadgen`` closed loop,
    the replayed profile, every cell cut to ``duration_s``."""
    def drive(url: str, tier: str, strategies: list[str], run_id: str) -> Path:
        flags = ["--tier", tier, "--output", output, "--strategies", ",".join(strategies),
                 "--duration", f"{duration_s:g}"]
        if tiers_path is not None:
            flags += ["--tiers-file", str(tiers_path)]
        if profile:
            flags += ["--profile", profile]
        return run_loadgen(url, flags, out_dir, run_id)
    return drive


def _run_tier(result: dict, i: int, row: dict, url: str, drive: Callable, policy: dict,
              slos: dict[str, Slo], output: str, duration_s: float, log) -> None:
    """Drive tier ``row`` (the ``i``-th) and add its rows, or its error, to ``result``."""
    names = pv.run_order(policy, row, i)
    run_id = (f"policy-{row['tier']}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-"
              f"{uuid.uuid4().hex[:6]}")
    log(f"validate: tier {row['tier']} ({row['users']} users, policy band {row['band']} "
        f"k={row['k']}): {', '.join(names)}, {duration_s:g} s per cell")
    try:
        run_dir = Path(drive(url, row["tier"], names, run_id))
        got = pv.measure(run_dir, slos)
    except (RuntimeError, OSError, ValueError) as exc:
        result["errors"][row["tier"]] = str(exc)[-500:]
        log(f"validate: tier {row['tier']}: no figure: {str(exc)[-300:]}")
        return
    result["runs"][row["tier"]] = str(run_dir)
    rows, errors = pv.tier_rows(policy, row, got, pv.steps_k(run_dir, policy["name"]), output,
                                run_dir)
    result["rows"].extend(rows)
    result["errors"].update(errors)


def validate_policy(policy: dict, manifest: dict | None, slos: dict[str, Slo], out_dir: Path,
                    duration_s: float = pv.DEFAULT_DURATION_S, output: str = "all",
                    base_config=None, deploy: Callable | None = None,
                    drive: Callable | None = None, log=print) -> dict:
    """Deploy the policy beside the best fixed deployments, drive every tier; returns the
    ``--validate --json`` dict {"policy": {"name", "base_strategy", "map"}, "duration_s",
    "deployed", "profile", "serve_config", "runs": {tier: run dir}, "rows": [``pv.tier_rows``
    rows], "errors": {tier: msg}}. ``output``: "short", "long" or "all" (the run's output
    classes). Raises ``PolicyError`` when the run has no tier to replay."""
    from analysis.decide.policy import DEFAULT_BASE_CONFIG

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = pv.level_plan(policy)
    cfg = pv.validation_config(policy, plan, base_config or DEFAULT_BASE_CONFIG)
    deployed = [e["name"] for e in cfg["applications"][0]["args"]["strategies"]]
    tiers_path, profile = _write_inputs(out_dir, manifest, cfg)
    deploy = deploy or default_deploy()
    drive = drive or default_drive(output, tiers_path, profile, duration_s, out_dir)
    result = {"policy": {"name": policy["name"], "base_strategy": policy["base_strategy"],
                         "map": policy["map"]},
              "duration_s": duration_s, "deployed": deployed, "profile": profile,
              "serve_config": str(out_dir / "policy-validate-serve.yaml"),
              "runs": {}, "rows": [], "errors": {}}
    log(f"validate: deploying {', '.join(deployed)} (one replica each) on a private Ray head")
    url, stop = deploy(cfg)
    try:
        for i, row in enumerate(plan):
            _run_tier(result, i, row, url, drive, policy, slos, output, duration_s, log)
    finally:
        stop()
    return result
