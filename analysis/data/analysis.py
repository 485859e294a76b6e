"""``Analysis``: everything the renderers need, computed once by ``analysis.report.build``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from analysis.data.load import Results
from configs.tiers import Slo


@dataclass
class Analysis:
    """Everything the renderers need (tables are pandas DataFrames)."""

    results: Results
    slos: dict[str, Slo]
    flagged: pd.DataFrame
    cells: pd.DataFrame
    positions: pd.DataFrame
    crossover: pd.DataFrame       # measured (per output class) + predicted (per strategy)
    knees: pd.DataFrame
    capacity: pd.DataFrame
    recommendation: dict
    outages: pd.DataFrame | None = None     # analysis.data.faults.outages: failed / rejected per cell
    timeline: pd.DataFrame | None = None    # analysis.data.faults.timeline: per strategy, 1 s bins
    degradation: pd.DataFrame | None = None
    baseline_root: str | None = None
    capacity_model: dict = field(default_factory=dict)  # analysis.report.capacity_section output
    questions: dict = field(default_factory=dict)       # analysis.decide.questions output
    warmup_s: float = 0.0                               # seconds cut from each cell's start
    race: dict = field(default_factory=dict)            # the run's racing settings (analysis.report.build.race_settings)
    claims: list[dict] = field(default_factory=list)    # analysis.decide.claims.claims_check rows
    figures: dict[str, bytes | None] = field(default_factory=dict)
    checks: dict[str, list[str]] = field(default_factory=dict)  # analysis.decide.checks: {figure: [sentences]}
    checks_run: int = 0                                 # comparisons the model checks made (failed or not)
    server: dict = field(default_factory=dict)         # analysis.report.server_section output
