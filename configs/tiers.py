"""Service tiers for the load generator (``configs/tiers.yaml``), validated with pydantic.

A *profile* (``cpu``, ``gpu``, ...) holds three tiers (``low``, ``mid``, ``high``
concurrency); each tier holds two *cells* (``short`` and ``long`` outputs). A cell
says how traffic arrives (closed: a fixed number of users that loop
request -> request; open: Poisson arrivals at ``rate_rps``), for how long, how
many tokens each request asks for, and the SLOs it is judged against. A cell may also fix output lengths (``ignore_eos``,
``min_tokens``) and list several sampling settings (``samplings``, at cell, tier
or profile level): each setting is then a cell of its own, labelled ``greedy``,
``t0.7``, ... (``Sampling.name``) in the request rows and the report.

Unknown keys are errors: ``load_tiers`` raises ``TierConfigError`` whose message
names the key path, e.g. ``profiles.cpu.tiers.low.short.userz``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from configs.metric_names import GREEDY

DEFAULT_TIERS_FILE = Path(__file__).with_name("tiers.yaml")
TIER_NAMES = ("low", "mid", "high")
OUTPUT_CLASSES = ("short", "long")


class TierConfigError(ValueError):
    """A tier file that cannot be read or does not match the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MaxTokens(_Strict):
    """max_tokens per request: ``{dist: fixed, value: N}`` or ``{dist: uniform, min: A, max: B}``.

    A bare integer in YAML means ``fixed``. Draws are seeded by the request index,
    so every strategy gets the same max_tokens for the same request.
    """

    dist: Literal["fixed", "uniform"] = "fixed"
    value: int | None = Field(default=None, ge=1)
    min: int | None = Field(default=None, ge=1)
    max: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _bare_int(cls, v: Any) -> Any:
        return {"dist": "fixed", "value": v} if isinstance(v, int) else v

    @model_validator(mode="after")
    def _check(self) -> "MaxTokens":
        if self.dist == "fixed":
            if self.value is None or self.min is not None or self.max is not None:
                raise ValueError("dist 'fixed' needs 'value' only, e.g. {dist: fixed, value: 32}")
        else:
            if self.min is None or self.max is None or self.value is not None:
                raise ValueError("dist 'uniform' needs 'min' and 'max' only, e.g. {dist: uniform, min: 64, max: 128}")
            if self.min > self.max:
                raise ValueError(f"min ({self.min}) > max ({self.max})")
        return self

    def sample(self, rng: random.Random) -> int:
        """One draw, in tokens."""
        if self.dist == "fixed":
            return int(self.value)  # type: ignore[arg-type]
        return rng.randint(int(self.min), int(self.max))  # type: ignore[arg-type]

    @property
    def upper(self) -> int:
        """Largest possible draw, tokens."""
        return int(self.value if self.dist == "fixed" else self.max)  # type: ignore[arg-type]


# Defaults when neither a tier file, a run manifest nor flags name an SLO. Chosen
# for an interactive chat service (first token within 2 s, >= 10 tokens/s per
# stream); the report states them so nobody mistakes them for measured values.
DEFAULT_TTFT_MS = 2000.0
DEFAULT_TPOT_MS = 100.0


class Slo(_Strict):
    """Latency objectives: a request meets them when TTFT <= ttft_ms and TPOT <= tpot_ms.

    The one SLO type of the project: tier cells hold one (``source`` "tier
    file"), and the analysis resolves one per tier (``analysis.data.slo``), saying
    where its numbers came from in ``source`` ("manifest", "flags",
    "flags+manifest", "default", ...; free text shown in the report).
    """

    ttft_ms: float = Field(DEFAULT_TTFT_MS, gt=0)   # time to first token, ms
    tpot_ms: float = Field(DEFAULT_TPOT_MS, gt=0)   # time per output token after the first, ms
    source: str = "tier file"


class Sampling(_Strict):
    """Sampling fields sent with every request of a cell (same for every strategy).

    ``label`` names the setting in request rows (column ``sampling``), the manifest and
    the report: ``greedy`` for temperature 0, else ``t<temperature>`` (``t0.7``), with
    ``-p<top_p>`` / ``-k<top_k>`` when those are set; give ``label`` to name it yourself.
    """

    temperature: float = Field(default=0.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)            # 0 = off
    seed: int | None = 0                           # request seed = seed + request index; null: omit
    stop: list[str] | None = None
    label: str | None = Field(default=None, min_length=1, max_length=40, pattern=r"^[A-Za-z0-9_.+-]+$")

    @property
    def name(self) -> str:
        """The label: ``label`` if given, else ``greedy`` / ``t0.7`` (+ ``-p0.9`` / ``-k50``)."""
        if self.label:
            return self.label
        if self.temperature == 0:
            return GREEDY
        out = f"t{self.temperature:g}"
        if self.top_p < 1:
            out += f"-p{self.top_p:g}"
        if self.top_k:
            out += f"-k{self.top_k}"
        return out


def _unique_labels(samplings: "list[Sampling] | None") -> "list[Sampling] | None":
    if samplings is not None:
        if not samplings:
            raise ValueError("samplings must list at least one setting (omit the key for the "
                             "profile's `sampling`)")
        names = [x.name for x in samplings]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"samplings: labels must be unique, {dup} repeat (two settings that "
                             "differ only by seed share a label: give each a `label`)")
    return samplings


class Cell(_Strict):
    """One tier x output class: how load is offered and judged.

    closed: ``users`` concurrent users, each sending its next request as soon as
    the previous one ends (no waves). open: Poisson arrivals at ``rate_rps``
    requests/s; ``users`` caps the requests in flight (late sends still count
    from their scheduled time, so an exhausted cap shows up as latency).
    """

    arrival: Literal["closed", "open"] = "closed"
    users: int = Field(ge=1)                       # closed: concurrency; open: in-flight cap
    rate_rps: float | None = Field(default=None, gt=0)  # open only, requests/s
    spawn_rate: float = Field(gt=0)                # users started per second
    duration_s: float = Field(gt=0)                # seconds of offered load (drain excluded)
    max_tokens: MaxTokens
    slo: Slo
    # Output lengths fixed the way peer benchmarks do (vLLM bench --ignore-eos): the server
    # keeps generating past EOS up to max_tokens; min_tokens (vLLM's field) forbids stopping
    # before that many tokens. Both are sent in the request body when set.
    ignore_eos: bool = False
    min_tokens: int | None = Field(default=None, ge=1)
    # several sampling settings: each is its own cell (label in the `sampling` column);
    # None: the tier's `samplings`, else the profile's
    samplings: list[Sampling] | None = None

    @model_validator(mode="after")
    def _rate_matches_arrival(self) -> "Cell":
        _unique_labels(self.samplings)
        lowest = self.max_tokens.value if self.max_tokens.dist == "fixed" else self.max_tokens.min
        if self.min_tokens is not None and self.min_tokens > int(lowest):  # type: ignore[arg-type]
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds the smallest max_tokens "
                             f"draw ({lowest}); a request cannot give more than max_tokens")
        if self.arrival == "open" and self.rate_rps is None:
            raise ValueError("arrival 'open' needs rate_rps (Poisson arrivals per second)")
        if self.arrival == "closed" and self.rate_rps is not None:
            raise ValueError("rate_rps is only for arrival 'open'; closed cells use 'users'")
        return self


class Tier(_Strict):
    short: Cell
    long: Cell
    samplings: list[Sampling] | None = None        # both cells' settings unless a cell names its own

    @model_validator(mode="after")
    def _labels(self) -> "Tier":
        _unique_labels(self.samplings)
        return self


class Tiers(_Strict):
    low: Tier
    mid: Tier
    high: Tier


class Profile(_Strict):
    """Everything one ``--profile`` needs besides the target and the prompts."""

    description: str = ""
    request_timeout_s: float = Field(default=120.0, gt=0)  # whole request, client side
    drain_timeout_s: float = Field(default=10.0, ge=0)     # wait for in-flight requests after a cell
    max_prompt_chars: int = Field(default=1200, ge=16)     # prompts are cut to this many characters
    seed: int = 0                                          # prompt order, max_tokens draws, arrivals
    sampling: Sampling = Sampling()
    # several settings, each its own cell (most specific wins: cell, tier, profile); None: [sampling]
    samplings: list[Sampling] | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)  # merged into every request body
    tiers: Tiers

    def cell(self, tier: str, output_class: str) -> Cell:
        if tier not in TIER_NAMES or output_class not in OUTPUT_CLASSES:
            raise KeyError(f"unknown cell {tier}/{output_class}: tiers are {TIER_NAMES}, "
                           f"outputs are {OUTPUT_CLASSES}")
        return getattr(getattr(self.tiers, tier), output_class)

    def samplings_for(self, tier: str, output_class: str) -> list[Sampling]:
        """The sampling settings of one tier x output class, in the file's order: the cell's
        ``samplings``, else the tier's, else the profile's, else ``[sampling]``."""
        cell = self.cell(tier, output_class)
        t = getattr(self.tiers, tier)
        return list(cell.samplings or t.samplings or self.samplings or [self.sampling])

    @model_validator(mode="after")
    def _labels(self) -> "Profile":
        _unique_labels(self.samplings)
        return self


class TiersFile(_Strict):
    default_profile: str = "cpu"
    profiles: dict[str, Profile]

    @model_validator(mode="after")
    def _default_exists(self) -> "TiersFile":
        if self.default_profile not in self.profiles:
            raise ValueError(f"default_profile {self.default_profile!r} is not one of "
                             f"{sorted(self.profiles)}")
        return self

    def profile(self, name: str | None = None) -> Profile:
        """The named profile (default: ``default_profile``); KeyError lists the known ones."""
        name = name or self.default_profile
        if name not in self.profiles:
            raise KeyError(f"profile {name!r} not in tier file; known: {sorted(self.profiles)}")
        return self.profiles[name]


def _format_error(path: Path | str, err: ValidationError) -> str:
    lines = [f"{path}: invalid tier file ({err.error_count()} error(s)):"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        lines.append(f"  {loc}: {e['msg']}")
    lines.append("  fix the key(s) above; the schema is configs/tiers.py")
    return "\n".join(lines)


def parse_tiers(data: Any, source: str = "<dict>") -> TiersFile:
    """Validate already-loaded YAML/JSON data; raises TierConfigError naming each bad key path."""
    try:
        return TiersFile.model_validate(data)
    except ValidationError as err:
        raise TierConfigError(_format_error(source, err)) from None


def load_tiers(path: Path | str | None = None) -> TiersFile:
    """Read and validate a tier file (default ``configs/tiers.yaml``).

    Raises TierConfigError for a missing file, bad YAML or a schema error; the
    message names the file and the dotted key path of every problem.
    """
    path = Path(path) if path else DEFAULT_TIERS_FILE
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TierConfigError(f"tier file {path} not found (default: {DEFAULT_TIERS_FILE})") from None
    except yaml.YAMLError as err:
        raise TierConfigError(f"{path}: not valid YAML: {err}") from None
    return parse_tiers(data, str(path))
