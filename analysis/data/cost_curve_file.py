"""Read a measured cost-curve file written by ``python -m bench.step_cost``.

Format: ``{"shape", "device", "points": [{"batch_size", "tokens_per_row",
"context_len", "step_ms"}, ...]}``. The plan needs step ms as a function of the
batch tokens a step verifies, so the grid is reduced to one curve: the points
at the context length closest to ``context_len`` (default: the largest
measured, the conservative choice), on a CPU device the thread CPU time
``cpu_ms`` when every point has it (else wall ``step_ms``), the median per distinct batch
tokens made non-decreasing (running maximum) (= batch_size x tokens_per_row; several (B, q) pairs can give the same
count), interpolated piecewise-linearly by ``analysis.decide.plan.PointsCurve``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field


class GridPoint(BaseModel):
    batch_size: int = Field(ge=1)
    tokens_per_row: int = Field(ge=1)
    context_len: int = Field(ge=0)
    step_ms: float = Field(gt=0)
    cpu_ms: float | None = Field(default=None, gt=0)


class GridCurveFile(BaseModel):
    """The ``bench.step_cost`` file (extra keys such as config are kept aside)."""

    shape: str
    device: str
    points: list[GridPoint] = Field(min_length=2)


def is_grid_file(data: dict) -> bool:
    """True for a cost-curve grid file (it names a ``shape``)."""
    return isinstance(data, dict) and "shape" in data


def grid_to_points(data: dict, context_len: float | None = None) -> tuple[list[tuple[float, float]], dict]:
    """[(batch_tokens, step_ms)] sorted, and a description {"shape", "device", "context_len"}.

    Raises pydantic.ValidationError for a malformed file and ValueError when fewer
    than two distinct batch-token counts remain."""
    spec = GridCurveFile.model_validate(data)
    df = pd.DataFrame([p.model_dump() for p in spec.points])
    ctxs = sorted(df["context_len"].unique())
    ctx = ctxs[-1] if context_len is None else min(ctxs, key=lambda c: abs(c - context_len))
    sel = df[df["context_len"].eq(ctx)].assign(t=lambda d: d["batch_size"] * d["tokens_per_row"])
    # a CPU curve measured on a shared machine: the thread's CPU time is the step's cost,
    # wall time adds the waits for a core that another machine would not have
    col = "cpu_ms" if spec.device == "cpu" and sel["cpu_ms"].notna().all() else "step_ms"
    agg = sel.groupby("t")[col].median().sort_index()
    # a forward over more tokens never costs less: timing noise must not give the
    # extrapolated last segment a negative slope
    agg[:] = np.maximum.accumulate(agg.to_numpy())
    if len(agg) < 2:
        raise ValueError(f"cost curve {spec.shape}: fewer than 2 distinct batch-token counts at "
                         f"context {ctx}")
    return ([(float(t), float(m)) for t, m in agg.items()],
            {"shape": spec.shape, "device": spec.device, "context_len": int(ctx), "clock": col})


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


CURVES_DIR = Path(__file__).resolve().parents[2] / "data" / "cost_curves"


def names() -> list[str]:
    """The committed curves' names (``data/cost_curves/NAME.json``)."""
    return sorted(p.stem for p in CURVES_DIR.glob("*.json"))


def resolve(name_or_path: str | Path) -> Path:
    """A curve file's path: an existing path as given, else ``data/cost_curves/NAME.json``.
    Raises ValueError naming the committed curves when neither exists."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    q = CURVES_DIR / f"{name_or_path}.json"
    if q.is_file():
        return q
    raise ValueError(f"cost curve {str(name_or_path)!r} is neither a file nor a committed curve; "
                     f"committed: {', '.join(names()) or 'none'}")


def argtype(text: str) -> str:
    """argparse type of ``--cost-curve``: a file or a committed curve's name -> its path."""
    import argparse
    try:
        return str(resolve(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
