"""Judging a capacity plan by a real run (``python -m analysis plan ... --validate``).

A plan says "N replicas of strategy S serve Q requests/s of this tier's traffic
within the SLOs". The campaign (``analysis.campaigns.plan_validation``) deploys exactly
that (a Serve app with S only, ``num_replicas`` N: ``serve_config``), drives open-loop
Poisson arrivals at Q (an open-loop tier file: ``tiers_file``; latency from the scheduled
send time, so an overloaded service cannot hide queueing), then repeats with N - 1
replicas. This module holds what the campaign needs to decide, no process of its own.

SLO attainment = requests meeting both SLOs / requests scheduled (errors,
timeouts and requests still in flight at the end count as misses); requests
scheduled in the first ``warmup_s`` seconds are left out (cold replicas).

Every run gets its own run directory (``validate-<strategy>-<N>-<stamp>``): the
load generator refuses an existing one, and reading a previous validation's
``requests.parquet`` instead once made two runs at different QPS report the same
246 requests. The load generator's exit status is checked, and so are the
arrivals: every row must carry the planned rate, and the number of scheduled
requests must be a plausible Poisson count for qps x duration
(``arrivals_check``), else that replica count gets no figure.
The plan holds when attainment(N) >= target; it is tight when
attainment(N - 1) < target. N - 1 = 0 replicas serve nothing: attainment 0.
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.data import metrics
from configs import metric_names as mn
from configs.paths import CONFIGS_DIR
from configs.tiers import TIER_NAMES, Slo

ARRIVALS_SIGMAS = 5.0       # a Poisson count further than this from qps x duration is wrong
DEFAULT_DURATION_S = 60.0
DEFAULT_WARMUP_S = 5.0
INFLIGHT_CAP = 512          # open-loop cell's cap on requests in flight
SERVE_YAML = CONFIGS_DIR / "serve.yaml"


@dataclass(frozen=True)
class Choice:
    """What is validated: strategy, output class, replicas planned, per-replica capacity."""

    strategy: str
    output_class: str
    replicas: int
    capacity_rps: float


def choose(plan_rows: list[dict], strategy: str | None = None,
           output_class: str | None = None) -> Choice:
    """The plan row (``analysis.decide.plan.model_plan``) to validate: the given strategy /
    output class, else the feasible row with the fewest replicas (then the highest
    per-replica capacity).

    Raises ValueError when no row is feasible or the named one is absent."""
    rows = [r for r in plan_rows if r.get("replicas")
            and (strategy is None or r["strategy"] == strategy)
            and (output_class is None or r["output_class"] == output_class)]
    if not rows:
        raise ValueError(f"no feasible plan row to validate (strategy={strategy}, "
                         f"output_class={output_class}); the plan says "
                         f"{[(r['strategy'], r['output_class'], r.get('note')) for r in plan_rows]}")
    r = min(rows, key=lambda r: (r["replicas"], -r["capacity_rps"], r["strategy"]))
    return Choice(r["strategy"], r["output_class"], int(r["replicas"]), float(r["capacity_rps"]))


def attainment(requests: pd.DataFrame, slo: Slo, warmup_s: float = DEFAULT_WARMUP_S) -> tuple[float, int]:
    """(share of scheduled requests meeting both SLOs, requests counted) after the warm-up.

    Every row counts (errors, timeouts, cancelled = misses); 0 rows -> (nan, 0)."""
    if requests.empty:
        return float("nan"), 0
    t0 = requests[mn.REQ_SCHEDULED_TS].min()
    sel = requests[requests[mn.REQ_SCHEDULED_TS] >= t0 + warmup_s]
    if sel.empty:
        return float("nan"), 0
    tiers = sel[mn.REQ_TIER].unique()
    good = metrics.meets_slo(sel, {t: slo for t in tiers})
    return float(good.mean()), int(len(sel))


def goodput(requests: pd.DataFrame, slo: Slo, warmup_s: float = DEFAULT_WARMUP_S,
            duration_s: float = DEFAULT_DURATION_S) -> float:
    """Output tokens/s of the requests meeting both SLOs, over the offered time after the
    warm-up (requests scheduled in the warm-up left out, as ``attainment``)."""
    if requests.empty or not duration_s > warmup_s:
        return float("nan")
    t0 = requests[mn.REQ_SCHEDULED_TS].min()
    sel = requests[requests[mn.REQ_SCHEDULED_TS] >= t0 + warmup_s]
    good = metrics.meets_slo(sel, {t: slo for t in sel[mn.REQ_TIER].unique()})
    return float(sel.loc[good, mn.REQ_OUTPUT_TOKENS].fillna(0).sum()) / (duration_s - warmup_s)


def arrivals_check(scheduled: int, qps: float, duration_s: float,
                   sigmas: float = ARRIVALS_SIGMAS) -> dict:
    """Is ``scheduled`` a plausible count of Poisson arrivals at ``qps`` over ``duration_s``?

    The count is Poisson with mean and variance ``qps * duration_s`` (requests); it is
    accepted within ``sigmas`` standard deviations (+1 for small means). Returns
    {"expected", "scheduled", "sigma", "ok"}. Raises ValueError for qps or duration <= 0."""
    if not (qps > 0 and duration_s > 0):
        raise ValueError(f"qps and duration_s must be > 0, got {qps!r}, {duration_s!r}")
    mean = float(qps) * float(duration_s)
    sd = math.sqrt(mean)
    return {"expected": mean, "scheduled": int(scheduled), "sigma": sd,
            "ok": bool(abs(scheduled - mean) <= sigmas * sd + 1.0)}


def check_run(requests: pd.DataFrame, qps: float, duration_s: float) -> dict:
    """The arrivals a validation run actually drove: every row at the planned rate
    (``request_rate_rps``) and a Poisson count of scheduled requests (``arrivals_check``).

    Raises RuntimeError naming what is wrong (a stale or foreign run directory, a load
    generator that stopped early)."""
    if requests.empty:
        raise RuntimeError("the load generator recorded no request")
    if mn.REQ_RATE_RPS in requests:
        rates = set(pd.to_numeric(requests[mn.REQ_RATE_RPS], errors="coerce").round(9))
        if rates != {round(float(qps), 9)}:
            raise RuntimeError(f"the run's requests were driven at {sorted(rates)} req/s, the "
                               f"plan's rate is {qps:g}: not this validation's run")
    check = arrivals_check(len(requests), qps, duration_s)
    if not check["ok"]:
        raise RuntimeError(f"{check['scheduled']} requests scheduled; Poisson at {qps:g} req/s for "
                           f"{duration_s:g} s expects {check['expected']:.0f} +- "
                           f"{ARRIVALS_SIGMAS:g} x {check['sigma']:.1f}")
    return check


def cpu_share(run_dir: Path) -> float | None:
    """Engine-thread CPU ms / step wall ms over a run's step log (``cpu_ms`` / ``step_ms``):
    below 1 the replicas waited for a core (other processes on a shared machine), which a
    plan fitted under other contention cannot foresee. None without a step log or CPU column."""
    path = Path(run_dir) / "steps.parquet"
    if not path.is_file():
        return None
    steps = pd.read_parquet(path)
    if mn.STEP_CPU_MS not in steps or steps[mn.STEP_CPU_MS].isna().all():
        return None
    wall = float(steps.loc[steps[mn.STEP_CPU_MS].notna(), mn.STEP_MS].sum())
    return float(steps[mn.STEP_CPU_MS].sum()) / wall if wall > 0 else None


def run_id_for(strategy: str, replicas: int) -> str:
    """A fresh run id per validation run: ``validate-<strategy>-<N>-<UTC stamp>-<6 hex>``."""
    return (f"validate-{strategy}-{replicas}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-"
            f"{uuid.uuid4().hex[:6]}")


def serve_config(strategy: str, replicas: int, base: Path = SERVE_YAML,
                 acceptance_length: float | None = None, engine: dict | None = None) -> dict:
    """configs/serve.yaml with only ``strategy``, at ``replicas`` replicas (1 torch thread each);
    ``acceptance_length``: its accept decision forced to that length (``rejection_sample_method:
    synthetic``, vLLM's names; ``plan --acceptance-length --validate``); ``engine``: engine
    fields set over the config's (``max_num_seqs``, ``max_waiting``).

    Raises ValueError when the base config has no such strategy, or A > k + 1."""
    cfg = yaml.safe_load(Path(base).read_text())
    app = cfg["applications"][0]
    entries = [copy.deepcopy(e) for e in app["args"]["strategies"]
               if e["engine"]["strategy"] == strategy]
    if not entries:
        raise ValueError(f"strategy {strategy!r} is not in {base}")
    entries[0]["num_replicas"] = int(replicas)
    entries[0].pop("autoscaling_config", None)
    entries[0]["engine"]["torch_threads"] = 1
    entries[0]["engine"].update(engine or {})
    if acceptance_length is not None:
        k = entries[0]["engine"].get("num_speculative_tokens")
        if isinstance(k, int) and acceptance_length > k + 1:
            raise ValueError(f"--acceptance-length {acceptance_length:g} above k + 1 = {k + 1} of "
                             f"{strategy} in {base}")
        entries[0]["engine"]["rejection_sample_method"] = "synthetic"
        entries[0]["engine"]["synthetic_acceptance_length"] = float(acceptance_length)
        entries[0]["engine"].pop("synthetic_acceptance_rates", None)
    app["args"]["strategies"] = entries[:1]
    return cfg


def tiers_file(tier: str, output_class: str, qps: float, duration_s: float, slo: Slo,
               max_tokens, request_timeout_s: float = 60.0) -> dict:
    """A one-profile tier file (``validate``) whose every cell is the open-loop cell:
    Poisson at ``qps`` for ``duration_s``, the run's max_tokens, the plan's SLOs."""
    cell = {"arrival": "open", "rate_rps": float(qps), "users": INFLIGHT_CAP,
            "spawn_rate": INFLIGHT_CAP, "duration_s": float(duration_s), "max_tokens": max_tokens,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}}
    t = {"short": cell, "long": cell}
    return {"default_profile": "validate", "profiles": {"validate": {
        "description": f"plan validation: {qps:g} req/s open loop, {tier}/{output_class}",
        "request_timeout_s": request_timeout_s, "drain_timeout_s": request_timeout_s,
        "max_prompt_chars": 1200, "seed": 0,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0},
        "tiers": {"low": t, "mid": t, "high": t}}}}


def load_tier(tier: str, manifest: dict | None = None) -> str:
    """The tier file tier whose cell the validation runs: ``tier`` itself, or for a
    sweep run (tier ``sweep``) the sweep's template tier (default ``high``)."""
    if tier in TIER_NAMES:
        return tier
    return ((manifest or {}).get("sweep") or {}).get("template_tier") or "high"


def run_max_tokens(manifest: dict | None, tier: str, output_class: str):
    """max_tokens of the planned tier/output class as the run used it (manifest
    profile; a sweep's template tier), else the shipped default profile's."""
    t = load_tier(tier, manifest)
    try:
        return manifest["profile"]["tiers"][t][output_class]["max_tokens"]
    except (TypeError, KeyError):
        from configs.tiers import load_tiers
        return load_tiers().profile(None).cell(t, output_class).max_tokens.model_dump()


def new_result(choice: Choice, qps: float, tier: str, slo: Slo, target: float,
               duration_s: float, warmup_s: float, acceptance_length: float | None) -> dict:
    """The ``--validate --json`` dict before any run: {"strategy", "output_class", "tier",
    "replicas", "qps", "slo_target", "slo", "duration_s", "warmup_s", "runs", "arrivals",
    "cpu_share", "goodput_tok_s", "acceptance_length", "measured_acceptance_length"} (the
    per-count mappings empty; ``record_count`` fills them)."""
    return {"strategy": choice.strategy, "output_class": choice.output_class, "tier": tier,
            "replicas": choice.replicas, "qps": qps, "slo_target": target,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "duration_s": duration_s, "warmup_s": warmup_s, "runs": {}, "arrivals": {},
            "cpu_share": {}, "goodput_tok_s": {}, "acceptance_length": acceptance_length,
            "measured_acceptance_length": {}}


def record_count(result: dict, n: int, key: str, req: pd.DataFrame, run_dir: Path, slo: Slo,
                 warmup_s: float, duration_s: float) -> tuple[float, int, float | None]:
    """Put one replica count's figures into ``result``: ``key`` (attainment) and its request
    count, goodput, the measured acceptance length (speculative runs), the run dir and the
    CPU share. Returns (attainment, requests counted, cpu share or None)."""
    count_key = "requests" if key == "attainment" else "requests_minus_one"
    att, count = attainment(req, slo, warmup_s)
    result[key], result[count_key] = att, count
    result["goodput_tok_s"][str(n)] = goodput(req, slo, warmup_s, duration_s)
    if mn.NUM_DRAFTS in req and req[mn.NUM_DRAFTS].fillna(0).sum() > 0:
        ok = req[req[mn.REQ_STATUS].eq(mn.STATUS_OK)]
        result["measured_acceptance_length"][str(n)] = metrics.pooled_tau(ok)
    result["runs"][str(n)] = str(run_dir)
    share = cpu_share(Path(run_dir))
    result["cpu_share"][str(n)] = share
    return att, count, share


def verdict(result: dict, target: float) -> dict:
    """``result`` with "holds" (attainment(N) >= target) and "tight" (attainment(N - 1) <
    target); None where that count has no figure."""
    att, att_m1 = result["attainment"], result["attainment_minus_one"]
    result["holds"] = None if att is None else bool(np.isfinite(att) and att >= target)
    result["tight"] = None if att_m1 is None else bool(att_m1 < target)
    return result
