"""The profiled step cost: a strategy's step model from the engine profile
(``python -m actors.profile``; the main job takes it after its cells), calibrated on a run's step log.

Where the capacity model used to fit ``analysis.model.stepcost.DecodeCost`` on the
steps of the run and extrapolate it to batches the run never reached, the step cost
here is measured on the engine that serves the run over the batch shapes the model
predicts (Vidur, Agrawal et al., MLSys 2024, section 4: operator profiles over the
batch grid, <9 % end-to-end error; BLIS: the verify width K + 1 inside the step cost):

- decode forward ``F(B, q, ctx)``: the profile's target forward (``engine.runner.run``)
  over batch rows B x tokens per row q (= T / B, the verification tokens per row) x
  context length per row, linear interpolation on that grid (scipy
  ``RegularGridInterpolator``; outside it, linear extrapolation from the edge cells);
- acceptance ``a(B)``: the engine's own ``verify_ms`` minus ``F`` at the strategy's
  own q, per batch (the verifier, sampling and KV rollback the forward does not hold);
- drafter ``D(B)``: the profile's ``draft_ms`` per batch (whole engine steps at batch B);
- prefill ``P(n)``: the prefill forward of n prompt tokens.

The profile is taken on the thread's CPU time where it has it (``cpu_ms``: a shared
machine's waits for a core are not the engine's cost); the run's step log then
calibrates each part with one scale per strategy (least squares through the origin of
the logged wall ms on the profiled ms, on the steps of the levels it is fitted on):
``verify_ms = s_v * (F + a)``, ``draft_ms = s_d * D``, prefill ``s_p * P``, and the
decode-only overhead is the run's median ``step - draft - verify``. The result is a
``stepcost.StepModel`` (``decode``, ``prefill``, ``draft_curve``) that
``analysis.model.backtest.model_point`` uses unchanged.

``find_profile`` looks for ``RUN_DIR/cost_curve.json`` beside each run of the results
(then ``data/cost_curves/embedded-<device>.json``). A vLLM-backed strategy is profiled the
same way on vLLM's engine (``actors.profile``: whole engine steps at fixed batches, its
``backend`` "vllm"); a strategy the profile lacks, or one it timed on another backend
(``profile_applies``), falls back to the step-log fit, which extrapolates beyond the
run's own levels (``StepModel.source`` says which).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.model import stepcost
from configs import metric_names as mn

PROFILE_FILE = "cost_curve.json"
PROFILE_KIND = "engine_profile"
COMMITTED_DIR = Path(__file__).resolve().parents[2] / "data" / "cost_curves"


def _clock(points: list[dict]) -> str:
    return "cpu_ms" if points and all(p.get("cpu_ms") for p in points) else "step_ms"


def _interp1(x: np.ndarray, y: np.ndarray):
    """Piecewise-linear y(x) with linear extrapolation from the end segments, >= 0."""
    order = np.argsort(x)
    x, y = np.asarray(x, float)[order], np.asarray(y, float)[order]

    def f(v):
        v = np.asarray(v, float)
        if x.size == 1:
            return np.full_like(v, y[0], dtype=float)
        lo = y[0] + (y[1] - y[0]) / (x[1] - x[0]) * (v - x[0])
        hi = y[-1] + (y[-1] - y[-2]) / (x[-1] - x[-2]) * (v - x[-1])
        return np.maximum(np.where(v < x[0], lo, np.where(v > x[-1], hi, np.interp(v, x, y))), 0.0)
    return f


@dataclass(frozen=True)
class ProfiledParts:
    """One strategy's profile, interpolated (units: ms; rows; tokens).

    ``forward(B, q, ctx)``: decode forward; ``accept(B)``: engine verify - forward;
    ``draft(B)``: the drafter per step; ``prefill(n)``: prefill forward of n tokens;
    ``batches``/``contexts``: the profiled ranges."""

    strategy: str
    grid: object            # scipy RegularGridInterpolator over (B, q, ctx)
    accept: object
    draft: object
    prefill: object
    batches: tuple[float, float]
    contexts: tuple[float, float]
    clock: str

    def forward(self, rows, q, ctx) -> np.ndarray:
        b, q, c = np.broadcast_arrays(np.asarray(rows, float), np.asarray(q, float),
                                      np.asarray(ctx, float))
        pts = np.column_stack([b.ravel(), q.ravel(), c.ravel()])
        return np.maximum(self.grid(pts), 0.0).reshape(b.shape)

    def verify(self, rows, tokens, attn) -> np.ndarray:
        """Profiled verify ms of a decode step: B rows, T tokens, A = T * ctx per row / 1000."""
        b = np.maximum(np.asarray(rows, float), 1e-9)
        t = np.maximum(np.asarray(tokens, float), 1e-9)
        q = t / b
        ctx = np.asarray(attn, float) * 1000.0 / t
        return self.forward(b, q, ctx) + self.accept(b)


def parts_from_profile(prof: dict, strategy: str) -> ProfiledParts | None:
    """The interpolated parts of ``strategy`` in an engine profile dict; None when the
    profile lacks it or its grid is not full (every B x q x ctx point)."""
    from scipy.interpolate import RegularGridInterpolator

    entry = (prof.get("strategies") or {}).get(strategy)
    if not entry or not entry.get("forward"):
        return None
    fwd = pd.DataFrame(entry["forward"])
    col = _clock(entry["forward"])
    bs, qs, cs = (np.sort(fwd[c].unique()).astype(float)
                  for c in ("batch_size", "tokens_per_row", "context_len"))
    table = fwd.pivot_table(index=["batch_size", "tokens_per_row", "context_len"], values=col,
                            aggfunc="median")
    vals = np.full((bs.size, qs.size, cs.size), np.nan)
    for (b, q, c), v in table[col].items():
        vals[np.searchsorted(bs, b), np.searchsorted(qs, q), np.searchsorted(cs, c)] = v
    if np.isnan(vals).any():
        return None
    # one axis with one value: duplicate it so the interpolator has a cell
    axes, data = [], vals
    for i, ax in enumerate((bs, qs, cs)):
        if ax.size == 1:
            ax = np.array([ax[0], ax[0] + 1.0])
            data = np.concatenate([data, data], axis=i)
        axes.append(ax)
    grid = RegularGridInterpolator(tuple(axes), data, method="linear", bounds_error=False,
                                   fill_value=None)
    steps = pd.DataFrame(entry.get("engine_steps") or [])
    sclock = _clock(entry.get("engine_steps") or [])
    if steps.empty:
        accept = _interp1(np.array([1.0]), np.array([0.0]))
        draft = _interp1(np.array([1.0]), np.array([0.0]))
    else:
        # the engine ran these steps on the wall clock of the profile; its CPU time is
        # split between draft and verify in the logged wall proportions
        share = (steps["cpu_ms"] / steps["step_ms"]).clip(upper=1.0) if sclock == "cpu_ms" \
            else pd.Series(1.0, index=steps.index)
        ver = steps["verify_ms"] * share
        dr = steps["draft_ms"] * share
        fw = ProfiledParts(strategy, grid, None, None, None, (0, 0), (0, 0), col).forward(
            steps["batch_size"], steps["tokens_per_row"], steps["context_per_row"])
        g = pd.DataFrame({"B": steps["batch_size"], "acc": (ver - fw).clip(lower=0.0), "d": dr})
        per_b = g.groupby("B").median()
        accept = _interp1(per_b.index.to_numpy(float), per_b["acc"].to_numpy(float))
        draft = _interp1(per_b.index.to_numpy(float), per_b["d"].to_numpy(float))
    pre = pd.DataFrame(entry.get("prefill") or [])
    if pre.empty:
        prefill = _interp1(np.array([1.0]), np.array([0.0]))
    else:
        pc = _clock(entry["prefill"])
        prefill = _interp1(pre["prefill_tokens"].to_numpy(float), pre[pc].to_numpy(float))
    return ProfiledParts(strategy, grid, accept, draft, prefill, (float(bs[0]), float(bs[-1])),
                         (float(cs[0]), float(cs[-1])), col)


@dataclass(frozen=True)
class ProfiledDecode:
    """``stepcost.DecodeCost``'s call signature on the profile: ``scale * parts.verify``
    (ms; B rows, T tokens, A attention work)."""

    parts: ProfiledParts
    scale: float
    r2: float = float("nan")
    n_steps: int = 0

    def __call__(self, rows, tokens, attn=0.0):
        return self.scale * self.parts.verify(rows, tokens, attn)


@dataclass(frozen=True)
class ScaledDraft:
    """The drafter's ms per step at B rows: ``scale * f(B)``."""

    f: object
    scale: float

    def __call__(self, rows):
        return self.scale * np.asarray(self.f(np.asarray(rows, float)), float)


@dataclass(frozen=True)
class ScaledCurve:
    """``scale * f(x) + const`` (the prefill step: its chunk's profiled forward, scaled, plus
    the step's overhead; ``CostCurve``'s call signature)."""

    f: object
    scale: float
    r2: float = float("nan")
    const: float = 0.0

    def __call__(self, x):
        return self.scale * self.f(x) + self.const


def _scale(y: np.ndarray, x: np.ndarray) -> float:
    """Least squares through the origin of y on x (1.0 without data)."""
    ok = np.isfinite(y) & np.isfinite(x)
    den = float(np.sum(x[ok] ** 2))
    return float(np.sum(x[ok] * y[ok]) / den) if den > 0 else 1.0


DRAFT_MIN_MS = 0.05   # a profiled drafter below this (autoregressive's bookkeeping) is no part


def calibrate(parts: ProfiledParts, steps: pd.DataFrame, strategy: str = "") -> stepcost.StepModel:
    """The profiled ``StepModel`` of one strategy, each part's scale fitted on its own column
    of ``steps`` (this strategy's step-log rows; least squares through the origin):

    - the drafter ``s_d``: the logged ``draft_ms`` on the profiled draft(B), decode steps;
    - the verify ``s_v``: the logged ``verify_ms`` on the profiled verify(B, T, A), decode-only
      steps; the step's overhead ``c``: their median ``step - draft - verify``;
    - the prefill ``s_p``: what a step with prompt tokens costs beyond its modelled decode part
      (``step - s_d draft - s_v verify - c``; a mixed step is one forward in the engine, and
      its ``verify_ms`` holds the prompt chunk too) on the profiled prefill(P).

    Each part on its own column: as regressors of one fit the drafter and the verify both grow
    with B and the constant trades against them, which extrapolates past the held-in batches
    badly (leave-one-level-out on the 2026-12-06 main job: tokens/s worst 32 % that way, 21 %
    this way). The run's clock (another build, a busier machine) enters as the scales. The
    drafter is a part only where the profile's drafter costs at least ``DRAFT_MIN_MS``.
    Raises ValueError with fewer than 3 decode steps."""
    f = stepcost.step_features(steps)
    f = f[(f["B"] > 0) | (f["P"] > 0)]
    if int((f["B"] > 0).sum()) < 3:
        raise ValueError(f"profiled step model of {strategy}: fewer than 3 decode steps")
    bb = f["B"].to_numpy(float)
    dec = bb > 0
    b1 = np.maximum(bb, 1.0)
    pv = np.where(dec, parts.verify(b1, np.maximum(f["T"].to_numpy(float), 1.0),
                                    f["A"].to_numpy(float)), 0.0)
    pdr = np.where(dec, parts.draft(b1), 0.0)
    pp = np.where(f["P"] > 0, parts.prefill(np.maximum(f["P"].to_numpy(float), 1.0)), 0.0)
    y = f["step_ms"].to_numpy(float)
    use_draft = bool(np.any(pdr >= DRAFT_MIN_MS))
    pure = dec & (f["P"].to_numpy(float) == 0)
    pure = pure if pure.any() else dec
    s_d = _scale(f["draft_ms"].to_numpy(float)[pure], pdr[pure]) if use_draft else 0.0
    s_v = _scale(f["verify_ms"].to_numpy(float)[pure], pv[pure])
    c = max(float(np.median((f["step_ms"] - f["draft_ms"] - f["verify_ms"]).to_numpy(float)[pure])),
            0.0)
    pre = f["P"].to_numpy(float) > 0
    s_p = _scale((y - s_d * pdr - s_v * pv - c)[pre], pp[pre]) if pre.any() else 1.0
    if not s_p > 0:
        s_p = 1.0
    decode = ProfiledDecode(parts, s_v)
    decode = dataclasses.replace(decode, r2=stepcost.r2_score(y[dec], s_v * pv[dec] + s_d * pdr[dec]
                                                         + c + s_p * pp[dec]),
                                 n_steps=int(dec.sum()))
    model = stepcost.StepModel(strategy, decode, ScaledCurve(parts.prefill, s_p, const=c), c,
                               (0.0, 0.0), draft_curve=ScaledDraft(parts.draft, s_d),
                               source="profiled")
    pred = np.asarray(model.step_ms(f["B"], f["T"], f["A"], f["P"]))
    return dataclasses.replace(model, r2_step=stepcost.r2_score(y, pred), n_steps=len(f),
                               residuals=y - pred, fitted=pred, is_prefill=(f["P"] > 0).to_numpy(),
                               loop_gap=stepcost.loop_gap(steps))


def _is_vllm(results, strategy: str) -> bool:
    for run in results.runs:
        m = (run.manifest.get("memory") or {}).get(strategy) or {}
        if str(m.get("backend", "embedded")) != "embedded":
            return True
    return False


def profile_applies(profile: dict | None, strategy: str, results=None) -> bool:
    """The profile has ``strategy`` timed on the engine the run served it with: its entry's
    ``backend`` (``embedded`` unless it says ``vllm``, ``actors.profile``) is the run's
    (the manifest's memory report; unknown without ``results``: the entry is taken)."""
    entry = ((profile or {}).get("strategies") or {}).get(strategy)
    if not entry:
        return False
    if results is None:
        return True
    run = "vllm" if _is_vllm(results, strategy) else "embedded"
    return str(entry.get("backend") or "embedded") == run


def find_profile(results, explicit: str | Path | None = None) -> tuple[dict | None, str | None]:
    """(engine profile dict, its path) for these results: ``explicit`` when given, else
    ``RUN_DIR/cost_curve.json`` of the first run that has one, else the committed
    ``data/cost_curves/embedded-<device>.json`` for the runs' device; (None, None) when
    none is an engine profile. Raises ValueError for an explicit file that is not one."""
    cands: list[Path] = []
    if explicit is not None:
        p = Path(explicit)
        data = json.loads(p.read_text())
        if data.get("kind") != PROFILE_KIND:
            raise ValueError(f"{p} is not an engine profile (python -m actors.profile)")
        return data, str(p)
    for run in getattr(results, "runs", ()):
        cands.append(Path(run.path) / PROFILE_FILE)
    devices = {str(m.get("device")) for run in getattr(results, "runs", ())
               for m in (run.manifest.get("memory") or {}).values() if isinstance(m, dict)}
    for d in sorted(devices):
        cands.append(COMMITTED_DIR / f"embedded-{d}.json")
    for p in cands:
        if p.is_file():
            try:
                data = json.loads(p.read_text())
            except ValueError:
                continue
            if data.get("kind") == PROFILE_KIND:
                return data, str(p)
    return None, None


def fit_step_models(steps: pd.DataFrame, profile: dict | None, results=None
                    ) -> dict[str, stepcost.StepModel]:
    """``{strategy: StepModel}``: the profiled model (``calibrate``) where the profile has
    the strategy and the run is the embedded engine's, else ``stepcost.fit_strategy``'s
    step-log fit (``source`` = "fitted")."""
    out = {}
    if steps is None or steps.empty:
        return out
    for strategy, g in steps.groupby(mn.STEP_STRATEGY, sort=True):
        strategy = str(strategy)
        parts = None
        if profile_applies(profile, strategy, results):
            parts = parts_from_profile(profile, strategy)
        try:
            out[strategy] = (calibrate(parts, g, strategy) if parts is not None
                             else stepcost.fit_strategy(g, strategy))
        except ValueError:
            continue
    return out
