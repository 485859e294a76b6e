"""One writer of the small tier files the load-generator tests run (``--tiers-file``)."""

from __future__ import annotations

from pathlib import Path

import yaml

TIERS = ("low", "mid", "high")


def write_tiers(directory: Path, cell: dict, *, low_short: dict | None = None,
                low_long: dict | None = None, request_timeout_s: float = 10,
                drain_timeout_s: float = 3, profile: str = "t", **profile_fields) -> Path:
    """Write ``directory/tiers.yaml``: one profile whose every tier and output class runs
    ``cell`` (users, spawn_rate, duration_s, max_tokens, slo, ...), the low tier's cells
    updated by ``low_short`` / ``low_long``; ``profile_fields`` go into the profile
    (seed, sampling, max_prompt_chars, ...). Returns the file's path."""
    tiers = {t: {"short": dict(cell), "long": dict(cell)} for t in TIERS}
    tiers["low"] = {"short": {**cell, **(low_short or {})}, "long": {**cell, **(low_long or {})}}
    doc = {"default_profile": profile, "profiles": {profile: {
        "request_timeout_s": request_timeout_s, "drain_timeout_s": drain_timeout_s,
        **profile_fields, "tiers": tiers}}}
    f = Path(directory) / "tiers.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f
