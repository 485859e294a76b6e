"""``python -m analysis policy RUN --validate``: run the derived policy against the best fixed
strategy at every tier of the run.

One Serve config (``validation_config``) carries the policy deployment (``<base>-policy``, its
``num_speculative_tokens_per_batch_size`` map: vLLM PR #32374) and, beside it, every
tier's best fixed deployment as measured (``analysis.decide.policy.fixed_entry``), each
one replica as in the measurement. It is deployed on a private Ray head and a free
loopback port (``cluster.launch.deploy_private``: the plan validation's bring-up), then
each tier is driven in turn with ``python -m loadgen --target URL --tier T`` against the policy and that tier's best
fixed deployment(s) (the order alternates from tier to tier, so a drift in the machine's
load favours neither): closed loop, the run's own profile (users, max_tokens, SLOs;
written from the run manifest's ``profile``), every cell cut to ``duration_s`` seconds
(``--duration``). The cluster is stopped at the end, whatever happened.

Per tier x output class the result gives, for the policy and the best fixed
deployment: output tokens/s, goodput tokens/s and SLO attainment (the share of
requests meeting both SLOs; ``analysis.data.metrics.cell_table``, judged against the
measurement run's SLOs), and for the policy the k its engine actually used
(step-log column ``num_speculative_tokens``: share of decode steps per k) and its
median running batch. Nothing is estimated here: every figure is measured on the
validation run.

The campaign itself (deploy, drive, stop) is ``analysis.campaigns.policy_validation``;
this module holds what it decides with, no process of its own. Errors: ``PolicyError``
when the run has no tier the profile knows.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd

from analysis.data import metrics
from analysis.data.load import load_results
from analysis.decide.policy import PolicyError, emit_serve_config, fixed_entry
from configs import metric_names as mn
from configs.tiers import TIER_NAMES, Slo, load_tiers, parse_tiers

DEFAULT_DURATION_S = 12.0
PROFILE_NAME = "policy-validate"


def tiers_file(manifest: dict | None) -> tuple[dict | None, str | None]:
    """(tier file dict, profile name) replaying the measurement run's profile: the
    manifest's ``profile`` when it validates as a profile (``configs.tiers``), else
    (None, the manifest's ``profile_name``) for the shipped tier file."""
    manifest = manifest or {}
    prof = manifest.get("profile")
    if isinstance(prof, dict):
        doc = {"default_profile": PROFILE_NAME, "profiles": {PROFILE_NAME: prof}}
        try:
            parse_tiers(copy.deepcopy(doc), "run manifest profile")
            return doc, PROFILE_NAME
        except Exception:  # noqa: BLE001  (another version's profile: use the named one)
            pass
    return None, manifest.get("profile_name") or load_tiers().default_profile


def level_plan(policy: dict) -> list[dict]:
    """Per measured tier of the policy: {"tier", "users", "band", "k", "fixed": {output
    class: best fixed deployment}}, low to high. Raises PolicyError when no level is a
    named tier (a sweep run: its levels have no tier to replay)."""
    rows = []
    for b in policy["bands"]:
        for lv in b["levels"]:
            info = policy["levels"][lv]
            if lv not in TIER_NAMES:
                continue
            fixed = {oc: v["strategy"] for oc, v in policy["best_fixed"].get(lv, {}).items()}
            rows.append({"tier": lv, "users": info["users"], "band": f"{b['lo']}-{b['hi']}",
                         "k": b["k"], "fixed": fixed})
    if not rows:
        raise PolicyError(f"--validate replays the run's tiers ({', '.join(TIER_NAMES)}); this "
                          f"run's levels are {sorted(policy['levels'])}")
    return sorted(rows, key=lambda r: TIER_NAMES.index(r["tier"]))


def steps_k(run_dir: Path, name: str) -> dict:
    """{"k_share": {k: share of decode steps}, "batch_p50", "steps"} of ``name`` in a run."""
    path = Path(run_dir) / "steps.parquet"
    if not path.is_file():
        return {"k_share": {}, "batch_p50": None, "steps": 0}
    st = pd.read_parquet(path)
    col = mn.STEP_MODEL if mn.STEP_MODEL in st else mn.STEP_STRATEGY
    st = st[st[col].eq(name) & st[mn.STEP_BATCH_SIZE].gt(0)]
    if st.empty:
        return {"k_share": {}, "batch_p50": None, "steps": 0}
    share = {}
    if mn.STEP_NUM_SPEC_TOKENS in st:
        vc = pd.to_numeric(st[mn.STEP_NUM_SPEC_TOKENS], errors="coerce").dropna().astype(int)
        share = {str(k): float(v) for k, v in (vc.value_counts(normalize=True).sort_index()).items()}
    return {"k_share": share, "batch_p50": float(st[mn.STEP_BATCH_SIZE].median()),
            "steps": int(len(st))}


def measure(run_dir: Path, slos: dict[str, Slo]) -> dict[tuple[str, str], dict]:
    """{(strategy, output class): {"tokens_per_s", "goodput_tok_s", "slo_attainment",
    "n_requests", "ttft_ms_p50", "tpot_ms_p50"}} of one validation run, judged against
    ``slos`` ({tier: Slo}, the measurement run's)."""
    res = load_results(run_dir)
    tiers = res.requests[mn.REQ_TIER].unique()
    flagged = metrics.with_slo_flags(res.requests, {t: slos[t] for t in tiers})
    cells = metrics.cell_table(flagged)
    out = {}
    for (s, oc), g in cells.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS]):
        n = int(g[mn.CELL_N_REQUESTS].sum())
        out[(s, oc)] = {
            "tokens_per_s": float(g[metrics.OUTPUT_TOKENS_PER_S].mean()),
            "goodput_tok_s": float(g[metrics.GOODPUT_TOKENS_PER_S].mean()),
            "slo_attainment": float((g[metrics.SLO_ATTAINMENT] * g[mn.CELL_N_REQUESTS]).sum() / n)
            if n else None,
            "n_requests": n, "ttft_ms_p50": float(g["ttft_ms_p50"].mean()),
            "tpot_ms_p50": float(g["tpot_ms_p50"].mean())}
    return out


def validation_config(policy: dict, plan: list[dict], base_config) -> dict:
    """The Serve config deployed: the policy plus every tier's best fixed deployment."""
    names = []
    for row in plan:
        for s in row["fixed"].values():
            if s not in names and s != policy["name"]:
                names.append(s)
    extra = [fixed_entry(s, policy["candidates"], base_config, policy.get("backend"))
             for s in names]
    return emit_serve_config(policy, base_config, extra)


def run_order(policy: dict, row: dict, i: int) -> list[str]:
    """The deployments tier ``row`` (the ``i``-th of ``level_plan``) drives: the policy and the
    tier's best fixed ones, the first rotated to the end on every other tier, so a drift in the
    machine's load favours neither."""
    names = [policy["name"]] + [s for s in dict.fromkeys(row["fixed"].values())
                                if s != policy["name"]]
    return names[1:] + names[:1] if i % 2 else names


def tier_rows(policy: dict, row: dict, got: dict, ksteps: dict, output: str,
              run_dir: Path) -> tuple[list[dict], dict[str, str]]:
    """One tier's result rows (policy against its best fixed deployment, per output class;
    ``validate_policy``'s "rows") and errors ({"tier/oc": why}) from ``measure``'s ``got`` and
    the policy's ``steps_k`` figures. ``output``: "short", "long" or "all"."""
    rows, errors = [], {}
    for oc, fixed in row["fixed"].items():
        if output != "all" and oc != output:
            continue
        p, f = got.get((policy["name"], oc)), got.get((fixed, oc))
        if p is None or f is None:
            errors[f"{row['tier']}/{oc}"] = (
                f"no requests for {'the policy' if p is None else fixed} in {run_dir}")
            continue
        rows.append({
            "tier": row["tier"], "output_class": oc, "users": row["users"],
            "band": row["band"], "k": row["k"],
            "policy": {"strategy": policy["name"], **p, **ksteps},
            "best_fixed": {"strategy": fixed, **f},
            "measurement_run": _measured_before(policy, row["tier"], oc),
            "tokens_ratio": p["tokens_per_s"] / f["tokens_per_s"] if f["tokens_per_s"] else None,
            "goodput_ratio": p["goodput_tok_s"] / f["goodput_tok_s"]
            if f["goodput_tok_s"] else None})
    return rows, errors


def _measured_before(policy: dict, tier: str, oc: str) -> dict:
    """What the measurement run said for this tier x output class: the deployment the policy's
    band was measured as, its tokens/s, goodput and attainment there, and the best fixed one's."""
    for b in policy["bands"]:
        if tier in b["levels"]:
            p = b["policy"].get(oc, {})
            f = b["best_fixed"].get(tier, {}).get(oc, {})
            return {"policy_as": p.get("strategy"), "policy_tokens_per_s": p.get("tokens_per_s"),
                    "policy_goodput_tok_s": p.get("goodput_tok_s"),
                    "policy_slo_attainment": p.get("slo_attainment"),
                    "best_fixed": f.get("strategy"), "fixed_tokens_per_s": f.get("tokens_per_s"),
                    "fixed_goodput_tok_s": f.get("goodput_tok_s"),
                    "fixed_slo_attainment": f.get("slo_attainment")}
    return {}


def table_rows(res: dict) -> list[dict]:
    """One display row per tier x output class of a ``validate_policy`` result."""
    rows = []
    for r in res["rows"]:
        p, f = r["policy"], r["best_fixed"]
        ks = ", ".join(f"k={k}: {v:.0%}" for k, v in p.get("k_share", {}).items())
        rows.append({"tier": r["tier"], "output_class": r["output_class"], "users": r["users"],
                     "band_k": f"{r['band']}: {r['k']}", "policy_tok_s": p["tokens_per_s"],
                     "policy_slo": p["slo_attainment"], "policy_k_steps": ks or "-",
                     "best_fixed": f["strategy"], "fixed_tok_s": f["tokens_per_s"],
                     "fixed_slo": f["slo_attainment"], "tokens_ratio": r["tokens_ratio"]})
    return rows
