"""Capacity plan: replicas needed per strategy for a target load under SLOs.

Model plan (always; ``plan["model"]``). Per strategy x output class of the tier, the
step cost model (``analysis.model.stepcost``, fitted per strategy on the whole step log,
calibrated per output class as in ``analysis.model.backtest``) gives each replica's
completions/s and TPOT at every batch size, measured or not; the queue model of
``analysis.model.replica_model`` turns them into the predicted SLO attainment of Poisson
arrivals at a rate (requests meeting both SLOs / requests sent, 429s and an
unstable queue counted as misses). replicas = the smallest N whose predicted
attainment at qps / N per replica >= ``attainment``; capacity_rps = the highest
per-replica rate that meets it. A row whose likely batch sizes lie beyond the
highest measured users level says it is extrapolated.

GPU plan (``--gpu`` or ``--cost-curve``). The step cost on the target GPU is a
roofline (Williams et al. 2009): ``step_ms(T) = 1000 * max(2*P*T / FLOPS,
2*P / bandwidth) + overhead_ms`` for T batch tokens and P parameters (bf16:
2 bytes and 2 FLOPs per parameter per token; KV-cache traffic and attention
FLOPs ignored), or a measured curve file ``{"gpu", "model", "points":
[{"batch_tokens", "step_ms"}]}`` interpolated piecewise-linearly. Measured
acceptance (tau, verification tokens per request v, draft/verify time ratio)
is combined with it: at concurrency N, step = g(N*v) * (1 + draft_ratio),
TPOT = step / tau, TTFT = g(prompt_tokens + N*v) * (1 + draft_ratio) (the
prefill rides in one mixed step; queueing ignored), W = TTFT + (out - 1) *
TPOT. N* is the largest N <= max_batch meeting both SLOs.

Memory (``--model-shape`` with ``--gpu``): the KV cache bounds the batch too.
Per sequence the target holds layers x KV heads x head_dim x 2 x 2 bytes per
context token (prompt + output + verification window), a draft model its own
cache; the weights (target + drafter) sit once per replica. N is capped at
``analysis.data.memory.max_concurrent_sequences`` and the row says when memory,
not compute, is the limit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from analysis.model import capacity
from analysis.data import memory
from analysis.data import metrics
from analysis.data import server as server_data
from analysis.model.capacity import CostCurve
from analysis.data.load import load_results
from configs import metric_names as mn
from configs.tiers import Slo

DEFAULT_ATTAINMENT = 0.9
DEFAULT_OVERHEAD_MS = 1.0
DEFAULT_MAX_BATCH = 1024


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet numbers: dense bf16 FLOP/s, HBM bytes/s, memory bytes."""

    name: str
    flops: float
    bandwidth: float
    memory_bytes: float


GPUS = {"h100": GpuSpec("H100 SXM", 989e12, 3.35e12, 80e9),
        "h200": GpuSpec("H200 SXM", 989e12, 4.8e12, 141e9)}


def roofline_curve(gpu: GpuSpec, params: float, overhead_ms: float = DEFAULT_OVERHEAD_MS) -> CostCurve:
    """Roofline step cost as a hinge: floor = weight read time + overhead, slope =
    2*P/FLOPS per token, knee = FLOPS / bandwidth tokens (the ridge point)."""
    read_ms = 1000.0 * 2.0 * params / gpu.bandwidth
    per_token_ms = 1000.0 * 2.0 * params / gpu.flops
    return CostCurve(floor_ms=read_ms + overhead_ms, slope_ms_per_token=per_token_ms,
                     knee_tokens=read_ms / per_token_ms)


class CurvePoint(BaseModel):
    batch_tokens: float = Field(gt=0)
    step_ms: float = Field(gt=0)


class CurveFile(BaseModel):
    """A measured step-cost curve: ``{"gpu", "model", "points": [...]}``."""

    gpu: str
    model: str
    points: list[CurvePoint] = Field(min_length=2)


@dataclass(frozen=True)
class PointsCurve:
    """Piecewise-linear step_ms(batch_tokens) through measured points; below the
    first point the first value, above the last the last segment's slope."""

    tokens: tuple[float, ...]
    ms: tuple[float, ...]

    @classmethod
    def from_file(cls, path: str | Path) -> "PointsCurve":
        """Read ``{"gpu", "model", "points": [{"batch_tokens", "step_ms"}]}`` or an
        ``bench.step_cost`` grid file (``analysis.data.cost_curve_file``)."""
        from analysis.data import cost_curve_file
        data = json.loads(Path(path).read_text())
        if cost_curve_file.is_grid_file(data):
            pts, _ = cost_curve_file.grid_to_points(data)
        else:
            spec = CurveFile.model_validate(data)
            pts = sorted((p.batch_tokens, p.step_ms) for p in spec.points)
        return cls(tuple(p[0] for p in pts), tuple(p[1] for p in pts))

    def __call__(self, tokens):
        t = np.asarray(tokens, dtype=float)
        x, y = np.array(self.tokens), np.array(self.ms)
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.where(t > x[-1], y[-1] + slope * (t - x[-1]), np.interp(t, x, y))


def load_curve(name_or_path: str | Path) -> tuple[PointsCurve, dict, Path]:
    """(curve, {"shape", "device", "dtype", "context_len", "clock"}, path) of a curve file or a
    committed curve's name (``analysis.data.cost_curve_file.resolve``; ValueError when neither)."""
    from analysis.data import cost_curve_file

    path = cost_curve_file.resolve(name_or_path)
    data = cost_curve_file.read(path)
    if cost_curve_file.is_grid_file(data):
        pts, meta = cost_curve_file.grid_to_points(data)
        meta["dtype"] = data.get("dtype")
    else:
        spec = CurveFile.model_validate(data)
        pts = sorted((q.batch_tokens, q.step_ms) for q in spec.points)
        meta = {"shape": spec.model, "device": spec.gpu, "dtype": None, "context_len": None,
                "clock": "step_ms"}
    return PointsCurve(tuple(x for x, _ in pts), tuple(y for _, y in pts)), meta, path


def model_plan(models: dict, qps: float, classes: list[str], slo: Slo,
               attainment: float = DEFAULT_ATTAINMENT) -> list[dict]:
    """Replicas per strategy x output class from the fitted capacity model (module doc):
    the smallest N whose predicted SLO attainment at ``qps / N`` per replica >= ``attainment``.

    ``models``: ``analysis.model.replica_model.fit_replica_models`` output."""
    from analysis.model.replica_model import replicas_needed

    rows = []
    for (strategy, oc), m in sorted(models.items()):
        if oc not in classes:
            continue
        n, at_n, below = replicas_needed(m, qps, slo, attainment)
        row = {"strategy": strategy, "output_class": oc, "replicas": n, "p99_in_system": None,
               "capacity_rps": m.slo_capacity_rps(slo, attainment),
               "saturation_rps": m.saturation_rps(), "max_num_seqs": m.max_num_seqs,
               "measured_users_max": m.measured_users}
        if n is None:
            row.update(predicted_attainment=None, predicted_attainment_minus_one=None,
                       mean_in_system=None, p99_in_system=None, tpot_ms=None, ttft_ms_p50=None,
                       extrapolated=None, capacity_rps=None,
                       note=f"predicted SLO attainment < {attainment:.0%} even at a trickle of load")
        else:
            row.update(predicted_attainment=at_n.attainment,
                       predicted_attainment_minus_one=below.attainment if below else 0.0,
                       mean_in_system=at_n.mean_in_system, p99_in_system=at_n.p99_in_system,
                       tpot_ms=at_n.tpot_ms, ttft_ms_p50=at_n.ttft_ms_p50,
                       extrapolated=at_n.extrapolated,
                       note=(f"extrapolated: the model's p99 of {min(at_n.p99_in_system, m.max_num_seqs)}"
                             f" requests in a replica's batch is beyond the highest measured users "
                             f"level ({m.measured_users})") if at_n.extrapolated else "")
        rows.append(row)
    return rows


def gpu_plan(curve, flagged: pd.DataFrame, steps: pd.DataFrame, qps: float, tier: str,
             slo: Slo, classes: list[str], max_batch: int = DEFAULT_MAX_BATCH,
             mem_caps: dict[tuple[str, str], int] | None = None,
             srv: pd.DataFrame | None = None) -> list[dict]:
    """Replicas per strategy x output class on a modelled GPU (see module doc).

    mem_caps: (strategy, output_class) -> most sequences whose KV cache fits a
    replica (``analysis.data.memory.gpu_memory_caps``); None: memory not modelled.
    srv: the target's own counters per cell (``analysis.data.server.cell_table``): tau and
    v where the requests carry no speculative stats and there is no step log.
    """
    cap = capacity.capacity_table(steps)
    v_by = capacity.verification_per_request(cap, flagged)
    srv_tau, srv_v = server_data.acceptance_by_class(srv, tier)
    ratio = capacity.draft_ratio(steps)
    ok = flagged[flagged[mn.REQ_STATUS].eq("ok") & flagged[mn.REQ_TIER].eq(tier)]
    n = np.arange(1, max_batch + 1, dtype=float)
    rows = []
    for oc in classes:
        for strategy, g in ok[ok[mn.REQ_OUTPUT_CLASS].eq(oc)].groupby(mn.REQ_STRATEGY):
            tau = metrics.pooled_tau(g)
            v, r = v_by.get(strategy, 1.0), ratio.get(strategy, 0.0)
            if np.isnan(tau) and (strategy, oc) in srv_tau:   # no per-request stats: the server's
                tau = srv_tau[(strategy, oc)]
                if strategy not in set(cap.get(mn.STEP_STRATEGY, [])):
                    v = srv_v.get((strategy, oc), v)
            tau = 1.0 if np.isnan(tau) else tau
            prompt = float(g[mn.REQ_PROMPT_TOKENS].mean()) if g[mn.REQ_PROMPT_TOKENS].notna().any() else 0.0
            out = float(g[mn.REQ_OUTPUT_TOKENS].mean())
            step = curve(n * v) * (1.0 + r)
            tpot, ttft = step / tau, curve(prompt + n * v) * (1.0 + r)
            feasible = np.nonzero((tpot <= slo.tpot_ms) & (ttft <= slo.ttft_ms))[0]
            row = {"strategy": strategy, "output_class": oc, "tau": tau, "v": v, "draft_ratio": r,
                   "prompt_tokens": prompt, "output_tokens": out}
            _size_gpu_row(row, (mem_caps or {}).get((strategy, oc)), feasible, n, step, tpot, ttft,
                          qps, max_batch)
            rows.append(row)
    return rows


def _size_gpu_row(row: dict, mem_cap: int | None, feasible: np.ndarray, n: np.ndarray,
                  step: np.ndarray, tpot: np.ndarray, ttft: np.ndarray, qps: float,
                  max_batch: int) -> None:
    """Fill one ``gpu_plan`` row in place: the largest batch meeting both SLOs within the KV
    cache's ``mem_cap`` sequences (None: memory not modelled), its TPOT / TTFT (ms), capacity
    (req/s), tokens/s and the replicas for ``qps``; ``limit`` says whether memory or
    compute / the SLOs bound it. ``n``: batch sizes 1..max_batch; ``step``, ``tpot``,
    ``ttft``: the modelled ms at each; ``feasible``: indices of ``n`` meeting the SLOs."""
    tau, out = row["tau"], row["output_tokens"]
    limit = "compute/SLO"
    if mem_cap is not None:
        row["max_seqs_memory"] = mem_cap
        if feasible.size and feasible[-1] + 1 > mem_cap:
            limit = "memory"
            compute_n = int(feasible[-1]) + 1
            feasible = feasible[feasible < mem_cap]
    row["limit"] = limit
    if mem_cap == 0:
        row.update(users=None, tpot_ms=float(tpot[0]), ttft_ms=float(ttft[0]),
                   capacity_rps=None, tokens_per_s=None, replicas=None,
                   note="weights leave no memory for a KV cache")
    elif feasible.size == 0:
        row.update(users=None, tpot_ms=float(tpot[0]), ttft_ms=float(ttft[0]),
                   capacity_rps=None, tokens_per_s=None, replicas=None,
                   note="SLO not met even at batch 1")
    else:
        i = int(feasible[-1])
        w = (ttft[i] + max(out - 1.0, 0.0) * tpot[i]) / 1000.0
        x = n[i] / w
        row.update(users=int(n[i]), tpot_ms=float(tpot[i]), ttft_ms=float(ttft[i]),
                   capacity_rps=x, tokens_per_s=float(n[i] * tau / step[i] * 1000.0),
                   replicas=math.ceil(qps / x - 1e-9),
                   note=(f"memory-bound: the KV cache fits {mem_cap} sequences; compute and "
                         f"the SLOs would allow {compute_n}" if limit == "memory" else
                         "capped by max_batch" if i == max_batch - 1 else ""))


def _one_sampling(results):
    """(results of the first sampling label only, every label): one sampling setting per
    plan (greedy first, ``analysis.data.dimensions.sampling_labels``); a run with one label
    is returned as it is."""
    import dataclasses

    from analysis.data.dimensions import sampling_labels

    labels = sampling_labels(results.requests)
    if len(labels) < 2:
        return results, labels
    req, st = results.requests, results.steps
    return dataclasses.replace(results, requests=req[req[mn.REQ_SAMPLING].eq(labels[0])],
                               steps=st[st[mn.REQ_SAMPLING].eq(labels[0]) | st[mn.REQ_SAMPLING].isna()]
                               ), labels


def _flagged(results, tier: str, slo_ttft_ms: float, slo_tpot_ms: float,
             slo_source: str) -> tuple[Slo, pd.DataFrame, pd.DataFrame, list[str]]:
    """The SLO, requests flagged against it, the cell table and the tier's output classes.
    Raises ValueError when ``tier`` is not in the results."""
    req = results.requests
    tiers = sorted(req[mn.REQ_TIER].unique())
    if tier not in tiers:
        raise ValueError(f"tier {tier!r} is not in the results (found {tiers}); pass one of them.")
    slo = Slo(ttft_ms=slo_ttft_ms, tpot_ms=slo_tpot_ms, source=slo_source)
    flagged = metrics.with_slo_flags(req, {t: slo for t in tiers})
    cells = metrics.cell_table(flagged)
    classes = sorted(req.loc[req[mn.REQ_TIER].eq(tier), mn.REQ_OUTPUT_CLASS].unique())
    return slo, flagged, cells, classes


def at_acceptance_length(models: dict, acceptance_length: float) -> tuple[dict, list[str]]:
    """The fitted replica models (``fit_replica_models``) of every real speculative strategy
    with its acceptance length set to ``acceptance_length`` (what a drafter of that
    acceptance would do with the same measured step costs: the step cost model depends on
    the batch's verification tokens, k + 1 per row, not on how many are accepted; each step
    then emits A tokens per request instead of the measured tau), autoregressive kept as
    it is. Strategies with k + 1 < A (verification tokens per row ``v``), synthetic
    deployments and autoregressive's are left out of the change; returns (models, notes)."""
    import dataclasses

    out, notes = {}, []
    for (strategy, oc), m in models.items():
        if strategy == mn.AUTOREGRESSIVE:
            out[(strategy, oc)] = m
            continue
        if mn.parse_acceptance_length(strategy) is not None:
            continue
        w = m.cell.workload
        if acceptance_length > w.v + 1e-9:
            notes.append(f"{strategy}/{oc}: A = {acceptance_length:g} above its k + 1 "
                         f"(~{w.v:.2f} verification tokens per row): left out")
            continue
        cell = dataclasses.replace(m.cell, workload=dataclasses.replace(w, tau=float(acceptance_length)))
        out[(strategy, oc)] = dataclasses.replace(m, cell=cell)
        notes.append(f"{strategy}/{oc}: measured acceptance length {w.tau:.2f} -> {acceptance_length:g}")
    return out, notes


BASIS_MEASURED_RATIO = 1.5   # an operating point within x/÷ 1.5 of a measured users level


def row_basis(row: dict, model, levels: list[float]) -> str:
    """``measured`` / ``interpolated`` / ``extrapolated`` for one plan row: its predicted
    mean requests in a replica (the operating concurrency) within x/÷ BASIS_MEASURED_RATIO of a
    users level the run measured for this strategy x output class: measured; its p99 inside
    the measured range, or inside the engine profile's batch grid when the step cost is
    profiled (``analysis.model.profiled``): interpolated; else extrapolated."""
    c, p99 = row.get("mean_in_system"), row.get("p99_in_system")
    if c is None or not levels:
        return "extrapolated"
    if min(abs(np.log(max(c, 1e-9) / u)) for u in levels) <= np.log(BASIS_MEASURED_RATIO):
        return "measured"
    top = max(levels)
    parts = getattr(getattr(model.cell.model, "decode", None), "parts", None)
    if model.cell.model.source == "profiled" and parts is not None:
        top = max(top, parts.batches[1])
    return "interpolated" if min(p99 or c, model.max_num_seqs) <= top else "extrapolated"


def measured_ranking(flagged: pd.DataFrame, cells: pd.DataFrame, tier: str, slo: Slo
                     ) -> dict[str, dict]:
    """{output class: the tier's measured decision} from the one decision function
    (``analysis.decide.recommend.recommend`` over ``analysis.decide.race``): "order"
    {strategy: 0 for the winner / the equivalent or still-contending strategies, 1 for those
    the run decided worse beyond its own noise}, "status", "leader", "users", "goodput"."""
    from analysis.decide.recommend import recommend

    tiers = sorted(flagged[mn.REQ_TIER].unique())
    rec = recommend(flagged, cells, {t: slo for t in tiers}).get(tier, {})
    out = {}
    for oc, r in rec.items():
        top = set(r.get("tied") or []) | set(r.get("equivalent") or []) | set(r.get("contenders") or [])
        if r.get("status") == "decided" and r.get("strategy") not in (None, "tie"):
            top = {r["strategy"]}
        top.add(r.get("leader") or r.get("strategy"))
        order = {s: (0 if s in top else 1) for s in (r.get("goodput_by_strategy") or {})}
        for s in r.get("dropped") or {}:
            if s not in top:
                order[s] = 1
        out[oc] = {"order": order, "status": r.get("status"), "leader": r.get("leader"),
                   "users": r.get("users"), "goodput": r.get("goodput_by_strategy") or {}}
    return out


def rank_rows(rows: list[dict], models: dict, flagged: pd.DataFrame, cells: pd.DataFrame,
              tier: str, slo: Slo, assumptions: list[str]) -> list[dict]:
    """The plan rows ordered per output class (the first row of each class is the tier's
    answer, the others its alternatives), each with ``rank``, ``basis``
    (``row_basis``) and ``measured`` (the measured goodput and decision at the tier's
    load). Order: the run's measured decision at this tier first (a strategy the run decided
    worse beyond its own noise never ranks above one it did not), then fewer replicas, then
    (when every row was measured at the tier) more measured goodput there, then more
    predicted capacity per replica (requests/s meeting the attainment), ties to
    autoregressive. Where the model alone would have ranked otherwise the row says so."""
    meas = measured_ranking(flagged, cells, tier, slo)
    out = []
    for oc in sorted({r["output_class"] for r in rows}):
        group = [r for r in rows if r["output_class"] == oc]
        mr = meas.get(oc) or {"order": {}, "goodput": {}}
        for r in group:
            m = models[(r["strategy"], oc)]
            levels = sorted(float(u) for u in cells.loc[cells[mn.REQ_STRATEGY].eq(r["strategy"])
                                                        & cells[mn.REQ_OUTPUT_CLASS].eq(oc),
                                                        mn.REQ_USERS].unique())
            r["basis"] = row_basis(r, m, levels)
            if r.get("extrapolated") is not None:
                r["extrapolated"] = r["basis"] == "extrapolated"
                if r["basis"] != "extrapolated" and (r.get("note") or "").startswith("extrapolated"):
                    r["note"] = ""
            r["step_model"] = m.cell.model.source
            r["measured_goodput_tok_s"] = mr["goodput"].get(r["strategy"])
            r["measured_decision"] = ("decided worse" if mr["order"].get(r["strategy"]) == 1 else
                                      mr.get("status") or "not measured")

        def model_key(r):
            return (r["replicas"] if r.get("replicas") else 1e9, -(r.get("capacity_rps") or 0.0),
                    r["strategy"] != mn.AUTOREGRESSIVE, r["strategy"])
        measured_all = all(r.get("measured_goodput_tok_s") is not None for r in group)

        def rank_key(r):
            # the measured decision, then replicas; among equal replica counts the goodput the
            # run measured at this tier (when every row has one) before the model's capacity
            k = model_key(r)
            seen = -(r["measured_goodput_tok_s"] or 0.0) if measured_all else 0.0
            return (mr["order"].get(r["strategy"], 1), k[0], seen) + k[1:]
        by_model = sorted(group, key=model_key)
        ranked = sorted(group, key=rank_key)
        if by_model[0] is not ranked[0]:
            ranked[0]["note"] = ((ranked[0].get("note") or "") + (
                f" ranked first by the measurement at tier {tier} ({mr.get('status')}; "
                f"users {mr.get('users')}): the model alone preferred {by_model[0]['strategy']}")).strip()
            assumptions.append(f"{oc}: the model's capacity ranking ({by_model[0]['strategy']} first) "
                               f"contradicts the run's measured decision at tier {tier} "
                               f"({mr.get('status')}, leader {mr.get('leader')}); the measurement ranks")
        for i, r in enumerate(ranked):
            r["rank"] = i + 1
        out += ranked
    return out


def tier_answer(rows: list[dict]) -> list[dict]:
    """Per output class the first ranked row (``rank_rows``): the strategy, replicas and
    predicted attainment the plan answers with, the alternatives named below it."""
    out = []
    for oc in sorted({r["output_class"] for r in rows}):
        group = sorted((r for r in rows if r["output_class"] == oc), key=lambda r: r.get("rank", 0))
        best = next((r for r in group if r.get("replicas")), None)
        if best is None:
            out.append({"output_class": oc, "strategy": None, "replicas": None,
                        "predicted_attainment": None, "basis": None,
                        "alternatives": "; ".join(r["strategy"] for r in group)})
            continue
        out.append({"output_class": oc, "strategy": best["strategy"], "replicas": best["replicas"],
                    "predicted_attainment": best["predicted_attainment"], "basis": best["basis"],
                    "step_model": best.get("step_model"),
                    "alternatives": "; ".join(f"{r['strategy']} ({r['replicas'] or '-'} replicas, "
                                              f"{r['basis']})" for r in group if r is not best)})
    return out


def _model_rows(results, flagged: pd.DataFrame, cells: pd.DataFrame, qps: float, tier: str,
                classes: list[str], slo: Slo, slo_ttft_ms: float, slo_tpot_ms: float,
                attainment: float, acceptance_length: float | None = None,
                engine_limits: dict | None = None) -> tuple[list[dict], list[str]]:
    """The model plan's rows (``model_plan``) and the assumptions list it starts;
    ``acceptance_length``: every speculative strategy's tau set to it (``at_acceptance_length``),
    each row then carries ``acceptance_length`` (the set A) and ``measured_acceptance_length``."""
    req = results.requests
    assumptions = [
        f"target load {qps:g} requests/s of tier {tier!r} ({', '.join(classes)} outputs); "
        f"SLO TTFT <= {slo_ttft_ms:g} ms, TPOT <= {slo_tpot_ms:g} ms",
        "model: per strategy the step cost (the engine profile calibrated on the step log where "
        "one exists, analysis.model.profiled; else the step-log fit, analysis.model.stepcost), "
        "calibrated per output class on the measured users levels; each replica a queue "
        "(analysis.model.replica_model) with Poisson arrivals at qps / N, batch <= max_num_seqs and "
        "429 beyond max_waiting (configs/serve.yaml); replicas = smallest N whose predicted "
        f"SLO attainment >= {attainment:.0%}",
        "replicas are independent, each with cores (or a GPU) of its own: replicas that share one "
        "machine's cores run slower than this (on a 2-core machine a second replica's engine "
        "threads ran 69% busy each at 20 req/s where one replica's ran 96% at 40 req/s: the "
        "second shares the cores it would need)",
    ]
    from analysis.model.replica_model import engine_limits as config_limits, fit_replica_models
    over = dict(engine_limits or {})

    def limits(strategy: str) -> tuple[int, int]:
        s, w = config_limits(strategy)
        return int(over.get("max_num_seqs", s)), int(over.get("max_waiting", w))
    if over:
        assumptions.append("per replica " + ", ".join(f"{k} {v}" for k, v in sorted(over.items()))
                           + " (flags, over the Serve config's; --validate deploys them)")
    models = fit_replica_models(results, flagged, cells, limits=limits, notes=assumptions)
    measured_tau = {key: m.cell.workload.tau for key, m in models.items()}
    if acceptance_length is not None:
        models, notes = at_acceptance_length(models, acceptance_length)
        assumptions.append(f"HYPOTHETICAL drafter: acceptance length {acceptance_length:g} per "
                           "verify step with the measured step costs (draft and verify of k + 1 "
                           "tokens per row as measured); " + "; ".join(notes))
    rows = model_plan(models, qps, classes, slo, attainment)
    for r in rows:
        key = (r["strategy"], r["output_class"])
        m = models[key]
        r["acceptance_length"] = m.cell.workload.tau
        r["measured_acceptance_length"] = measured_tau.get(key)
        # predicted goodput at the planned load over the N replicas: tokens/s of requests meeting the SLOs
        r["goodput_tok_s"] = (qps * r["predicted_attainment"] * m.out_tokens
                              if r.get("replicas") and r.get("predicted_attainment") is not None else None)
    rows = rank_rows(rows, models, flagged, cells, tier, slo, assumptions)
    missing = sorted(set(req[mn.REQ_STRATEGY]) - {r["strategy"] for r in rows})
    if missing:
        assumptions.append(f"no step log (or < 3 decode steps) for {', '.join(missing)}: no "
                           "model, no plan row")
    if any(r.get("extrapolated") for r in rows):
        assumptions.append("EXTRAPOLATED past the highest measured users level for the rows "
                           "marked extrapolated: the step cost model, not a measurement")
    return rows, assumptions


def _step_curve(gpu: str | None, model_params: float | None, cost_curve: str | Path | None,
                overhead_ms: float, assumptions: list[str]):
    """The GPU's step cost (ms) per batch tokens: the measured curve file, else the roofline;
    appends what it assumed. Raises ValueError when the roofline lacks ``model_params``."""
    if cost_curve is not None:
        curve = PointsCurve.from_file(cost_curve)
        assumptions.append(f"step cost: measured curve {cost_curve} "
                           f"({len(curve.tokens)} points, piecewise linear, last slope extrapolated)")
        return curve
    if model_params is None:
        raise ValueError("--gpu needs --model-params (target parameters, e.g. 8e9)")
    spec = GPUS[gpu]
    curve = roofline_curve(spec, model_params, overhead_ms)
    assumptions.append(
        f"step cost: roofline on {spec.name} ({spec.flops / 1e12:g} TFLOP/s bf16 dense, "
        f"{spec.bandwidth / 1e12:g} TB/s), {model_params:g} params in bf16: "
        f"step_ms = max({curve.floor_ms - overhead_ms:.3f} ms weight read, "
        f"{curve.slope_ms_per_token * 1000:.3f} us/token) + {overhead_ms:g} ms overhead; "
        f"ridge at {curve.knee_tokens:.0f} batch tokens; KV-cache traffic and attention "
        "FLOPs ignored; one GPU per replica")
    if 2 * model_params > 0.8 * spec.memory_bytes:
        assumptions.append(f"WARNING: bf16 weights ({2 * model_params / 1e9:.0f} GB) exceed 80% "
                           f"of {spec.name} memory; tensor parallelism is not modelled")
    return curve


def _memory_caps(results, flagged: pd.DataFrame, tier: str, gpu: str, shape,
                 gpu_memory_utilization: float,
                 assumptions: list[str]) -> tuple[dict[tuple[str, str], int], list[dict]]:
    """Most sequences whose KV cache fits a replica, per (strategy, output class), and the
    memory rows (``memory.gpu_memory_caps``); appends what it assumed."""
    spec = GPUS[gpu]
    v_by = capacity.verification_per_request(capacity.capacity_table(results.steps), flagged)
    ok = flagged[flagged[mn.REQ_STATUS].eq(mn.STATUS_OK) & flagged[mn.REQ_TIER].eq(tier)]
    contexts = {(s, oc): float((g[mn.REQ_PROMPT_TOKENS].fillna(0) + g[mn.REQ_OUTPUT_TOKENS]).mean())
                + v_by.get(s, 1.0)
                for (s, oc), g in ok.groupby([mn.REQ_STRATEGY, mn.REQ_OUTPUT_CLASS])}
    reports: dict = {}
    for run in results.runs:
        reports.update(run.manifest.get("memory") or {})
    rows = memory.gpu_memory_caps(shape, spec.memory_bytes, contexts, reports,
                                  utilization=gpu_memory_utilization)
    caps = {(r["strategy"], r["output_class"]): r["max_seqs"] for r in rows}
    assumptions.append(
        f"memory: {shape.name} ({shape.num_params() / 1e9:.2f}B params, "
        f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} head dim "
        f"x 2 (K, V) x 2 bytes = {shape.kv_bytes_per_token()} KV bytes per token) on "
        f"{spec.name} ({spec.memory_bytes / 1e9:g} GB, {gpu_memory_utilization:.0%} usable); "
        "context per sequence = mean prompt + output tokens + v (verification window); "
        "drafter weights and KV scaled from this run's replica reports by their ratio to the "
        "target; activations and CUDA context inside the unused share")
    return caps, rows


def plan(results_dir, qps: float, tier: str, slo_ttft_ms: float, slo_tpot_ms: float,
         gpu: str | None = None, model_params: float | None = None,
         cost_curve: str | Path | None = None, attainment: float = DEFAULT_ATTAINMENT,
         overhead_ms: float = DEFAULT_OVERHEAD_MS, max_batch: int = DEFAULT_MAX_BATCH,
         model_shape: str | None = None,
         gpu_memory_utilization: float = memory.DEFAULT_GPU_MEMORY_UTILIZATION,
         slo_source: str = "flags", acceptance_length: float | None = None,
         engine_limits: dict | None = None) -> dict:
    """Plan replicas for ``qps`` requests/s of ``tier`` traffic under the SLOs.

    ``engine_limits``: {"max_num_seqs", "max_waiting"} per replica over the Serve config's
    (what ``--validate`` then deploys).

    ``slo_source`` says where the SLO came from (``flags``, ``manifest``, ...; see
    ``analysis.data.slo.resolve_slos``); it is recorded in the returned ``slo``.
    ``acceptance_length``: plan for a drafter of that acceptance length instead of the
    measured one (``at_acceptance_length``; the model plan only).

    Returns {"qps", "tier", "slo", "model": [rows], "gpu_plan": [rows] or None,
    "assumptions": [str], "memory": [rows] or None}. ``model_shape`` (a name in
    ``analysis.data.memory.SHAPES`` or a config.json path, needs ``gpu``) adds the KV-cache
    cap and supplies model_params when absent. Raises ValueError when the tier
    is absent, --gpu lacks model_params / model_shape, or the shape is unknown;
    analysis.data.load.ResultsError for bad results dirs.
    """
    results, labels = _one_sampling(load_results(results_dir))
    slo, flagged, cells, classes = _flagged(results, tier, slo_ttft_ms, slo_tpot_ms, slo_source)
    rows, assumptions = _model_rows(results, flagged, cells, qps, tier, classes, slo,
                                    slo_ttft_ms, slo_tpot_ms, attainment, acceptance_length,
                                    engine_limits)
    if len(labels) > 1:
        assumptions.append(f"sampling: the {labels[0]!r} cells only (the run also measured "
                           f"{', '.join(labels[1:])}; acceptance, hence capacity, differs by setting)")
    out = {"qps": qps, "tier": tier, "slo": slo.model_dump(), "assumptions": assumptions,
           "answer": tier_answer(rows), "model": rows, "gpu_plan": None, "memory": None}
    if model_shape is not None and gpu is None:
        raise ValueError("--model-shape needs --gpu (the GPU whose memory holds the KV cache)")
    shape = memory.resolve_shape(model_shape) if model_shape is not None else None
    if shape is not None and model_params is None and cost_curve is None:
        model_params = float(shape.num_params())
    if gpu is None and cost_curve is None:
        return out
    curve = _step_curve(gpu, model_params, cost_curve, overhead_ms, assumptions)
    assumptions.append("acceptance: tau and verification tokens per request (v) measured here; "
                       "draft cost = measured draft_ms / verify_ms ratio; prefill of the mean "
                       f"prompt rides in one mixed step; batch <= {max_batch}")
    caps = None
    if shape is not None:
        caps, out["memory"] = _memory_caps(results, flagged, tier, gpu, shape,
                                           gpu_memory_utilization, assumptions)
    out["gpu_plan"] = gpu_plan(curve, flagged, results.steps, qps, tier, slo, classes, max_batch,
                               mem_caps=caps, srv=server_data.cell_table(results))
    if cost_curve is not None:
        from analysis.decide import crossover
        ccurve, meta, path = load_curve(cost_curve)
        assumptions.append(crossover.describe(path, meta, ccurve))
        out["crossover"] = crossover.crossover_rows(ccurve, results, max_batch)
    return out
