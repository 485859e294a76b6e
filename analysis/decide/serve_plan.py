"""From a capacity plan to a deployable Ray Serve config (``plan --emit-serve-config``).

The plan (``analysis.decide.plan.plan``) gives replicas per strategy x output class.
This module turns it into the same Serve config ``configs/serve.yaml`` is
(an ``applications`` list whose ``actors.serve.app:build_app`` args validate
with ``configs.serve_config.ServeAppConfig``), so it deploys with
``serve deploy out.yaml`` or ``python -m cluster up --config out.yaml``:

- replicas per strategy = the largest count over the tier's output classes
  (the plan sizes each class as if it carried all of ``qps``; taking the
  maximum covers any mix of them);
- the GPU plan's count when one was computed (``--gpu`` / ``--cost-curve``;
  the model assumes one GPU per replica, so ``num_gpus: 1`` and
  ``device: cuda`` are set), else the model plan's (``analysis.decide.plan.model_plan``);
- strategies the plan found infeasible (SLOs missed even at a trickle of load)
  or that the run did not measure are left out, and named in the header;
- everything else (engine settings, runtime_env, ingress, http_options) is
  copied from the base config.

``cluster_fit`` checks the result against a Ray cluster launcher YAML
(``cluster/cluster.yaml``): for each worker node type, how many nodes the
replicas' resources need and whether that lies within ``min_workers`` ..
``max_workers``.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

from configs.paths import CONFIGS_DIR, PACKAGE_ROOT
from configs.serve_config import ServeAppConfig

APP_IMPORT_PATH = "actors.serve.app:build_app"
DEFAULT_BASE_CONFIG = CONFIGS_DIR / "serve.yaml"
DEFAULT_CLUSTER_YAML = PACKAGE_ROOT / "cluster" / "cluster.yaml"


class ServePlanError(ValueError):
    """The plan cannot be turned into a Serve config (nothing feasible, bad base config)."""


def planned_replicas(plan_out: dict) -> dict[str, dict[str, Any]]:
    """``{strategy: {"replicas": int, "source": "gpu_plan"|"model", "output_class": str}}``.

    Only strategies with a finite replica count in the chosen plan appear;
    the count is the maximum over output classes (module docstring).
    """
    source = "gpu_plan" if plan_out.get("gpu_plan") else "model"
    out: dict[str, dict[str, Any]] = {}
    for row in plan_out.get(source) or []:
        n = row.get("replicas")
        if n is None:
            continue
        cur = out.get(row["strategy"])
        if cur is None or int(n) > cur["replicas"]:
            out[row["strategy"]] = {"replicas": int(n), "source": source,
                                    "output_class": row["output_class"]}
    return out


def _app(cfg: dict, path: Path) -> dict:
    apps = [a for a in cfg.get("applications") or [] if a.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        raise ServePlanError(f"{path}: no application with import_path {APP_IMPORT_PATH!r}")
    return apps[0]


def emit_serve_config(plan_out: dict, base_config: str | Path = DEFAULT_BASE_CONFIG) -> dict:
    """The Serve deploy config (a dict, YAML-ready) for ``plan_out``.

    Raises ServePlanError when no strategy of the base config has a feasible
    plan. The returned app args validate with ``ServeAppConfig``.
    """
    base_config = Path(base_config)
    cfg = copy.deepcopy(yaml.safe_load(base_config.read_text()))
    app = _app(cfg, base_config)
    args = ServeAppConfig.model_validate(app.get("args") or {})   # the base must be valid too
    planned = planned_replicas(plan_out)
    gpu = any(p["source"] == "gpu_plan" for p in planned.values())
    kept, dropped = [], []
    for raw, entry in zip(app["args"]["strategies"], args.strategies):
        p = planned.get(entry.name)
        if p is None:
            dropped.append(entry.name)
            continue
        raw = copy.deepcopy(raw)
        raw.pop("autoscaling_config", None)
        raw["num_replicas"] = p["replicas"]
        if gpu:   # the GPU plan's step-cost model is one GPU per replica
            opts = raw.setdefault("ray_actor_options", {})
            opts["num_gpus"] = 1
            raw.setdefault("engine", {})["device"] = "cuda"
        kept.append(raw)
    if not kept:
        raise ServePlanError(
            f"no strategy of {base_config} has a feasible plan (planned: {sorted(planned) or 'none'}); "
            "relax the SLOs or measure more users levels")
    app["args"]["strategies"] = kept
    ServeAppConfig.model_validate(app["args"])
    cfg["applications"] = [app]
    cfg["_dropped"] = dropped   # popped by write_serve_config (header comment)
    return cfg


def _replica_demand(app_args: dict) -> list[dict[str, float]]:
    """One resource dict per replica (strategies and ingress)."""
    args = ServeAppConfig.model_validate(app_args)
    demand = []
    for e in args.strategies:
        o = e.ray_actor_options
        n = e.num_replicas or (e.autoscaling_config.max_replicas if e.autoscaling_config else 1)
        demand += [{"CPU": o.num_cpus, "GPU": o.num_gpus, **o.resources}] * n
    o = args.ingress.ray_actor_options
    demand += [{"CPU": o.num_cpus, "GPU": o.num_gpus}] * args.ingress.num_replicas
    return demand


def cluster_fit(serve_cfg: dict, cluster_yaml: str | Path = DEFAULT_CLUSTER_YAML) -> list[dict]:
    """Worker nodes each node type needs for the config's replicas, against its bounds.

    A replica that asks for a GPU (or a custom resource) goes to the worker
    node type offering it; CPU-only replicas stay on the head. Returns rows
    ``{"node_type", "nodes_needed", "min_workers", "max_workers", "fits"}``
    (nodes_needed = ceil(sum of demand / per-node amount), the worst resource;
    first-fit packing can need one more node with fractional shares).
    Raises ServePlanError when a replica asks for a resource no node type has.
    """
    cluster = yaml.safe_load(Path(cluster_yaml).read_text())
    types = cluster["available_node_types"]
    head = cluster["head_node_type"]
    app = _app(serve_cfg, Path(cluster_yaml))
    totals: dict[str, dict[str, float]] = {}
    for d in _replica_demand(app["args"]):
        special = {k: v for k, v in d.items() if k != "CPU" and v}
        if not special:
            continue   # CPU-only: head (ingress, controller, proxy)
        candidates = [t for t, spec in types.items() if t != head and all(
            spec.get("resources", {}).get(k, 0) >= v for k, v in special.items())]
        if not candidates:
            raise ServePlanError(f"a replica needs {special}; no worker node type in {cluster_yaml} "
                                 "offers it")
        acc = totals.setdefault(candidates[0], {})
        for k, v in d.items():
            acc[k] = acc.get(k, 0.0) + v
    rows = []
    for t, spec in types.items():
        if t == head:
            continue
        need = totals.get(t, {})
        res = spec.get("resources", {})
        nodes = max([math.ceil(v / res[k] - 1e-9) for k, v in need.items() if res.get(k)] or [0])
        lo, hi = int(spec.get("min_workers", 0)), int(spec.get("max_workers", 0))
        rows.append({"node_type": t, "nodes_needed": nodes, "min_workers": lo, "max_workers": hi,
                     "fits": nodes <= hi})
    return rows


def write_serve_config(cfg: dict, path: str | Path, plan_out: dict,
                       fit: list[dict] | None = None) -> Path:
    """Write ``cfg`` as YAML with a header naming the plan it came from."""
    cfg = dict(cfg)
    dropped = cfg.pop("_dropped", [])
    planned = planned_replicas(plan_out)
    slo = plan_out.get("slo") or {}
    lines = [f"# Serve config emitted by `python -m analysis plan` for {plan_out['qps']:g} requests/s "
             f"of tier {plan_out['tier']!r}",
             f"# (SLO TTFT <= {slo.get('ttft_ms', float('nan')):g} ms, TPOT <= "
             f"{slo.get('tpot_ms', float('nan')):g} ms). Deploy: `serve deploy {Path(path).name}` or",
             f"# `python -m cluster up --config {Path(path).name}`.",
             "# replicas per strategy (max over output classes): " + ", ".join(
                 f"{s}={p['replicas']} ({p['source']}, {p['output_class']})" for s, p in planned.items()
                 if s not in dropped)]
    if dropped:
        lines.append(f"# left out (no feasible plan, or not measured): {', '.join(dropped)}")
    for row in fit or []:
        lines.append(f"# cluster node type {row['node_type']}: needs {row['nodes_needed']} nodes, "
                     f"bounds {row['min_workers']}..{row['max_workers']}"
                     + ("" if row["fits"] else "  <-- DOES NOT FIT: raise max_workers"))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path
