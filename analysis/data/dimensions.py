"""The dimensions a run may vary besides tier and output class: the deployment's draft
length k and candidate count (``python -m loadgen --k`` / ``--top-k-candidates``: one
deployment per variant) and the cell's sampling setting (``configs/tiers.py``
``samplings``; request column ``sampling``, part of ``metric_names.CELL_KEY``).

``add_dimensions`` gives every request row, at load time:

- ``sampling`` / ``temperature``: as the load generator wrote them; older runs (schema
  version < 5) get the label and temperature of their profile's one ``sampling``
  setting from the manifest (``greedy`` when the manifest has none).
- ``base_strategy``, ``k`` (num_speculative_tokens), ``top_k_candidates``: from the
  manifest's ``variants`` table (written with ``--k``), else from the deployment's
  name (``metric_names.parse_variant_name``: ``dflash2-k4-c16``), else ``k`` from the
  replica's memory report in the manifest (``memory.<name>.num_speculative_tokens``;
  ``autoregressive`` is k = 0). Unknown values stay null.
- ``synthetic_acceptance_length``: a forced-acceptance deployment's A (``--acceptance-length``:
  manifest ``variants``, else the name's ``-al<A>``); NaN for a real deployment.
- ``category``: the prompt's traffic class (``request_category``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from configs import metric_names as mn

BASE_STRATEGY, K, CANDIDATES = "base_strategy", "k", "top_k_candidates"
# --acceptance-length: a deployment's forced acceptance length (NaN: a real deployment)
SYNTHETIC_AL = "synthetic_acceptance_length"


def profile_sampling(manifest: dict) -> tuple[str, float]:
    """(label, temperature) of a manifest's profile ``sampling`` (``greedy``, 0.0 without one)."""
    from configs.tiers import Sampling

    raw = ((manifest or {}).get("profile") or {}).get("sampling")
    try:
        s = Sampling(**raw) if isinstance(raw, dict) else Sampling()
    except Exception:  # noqa: BLE001  (a manifest from another version: fall back to greedy)
        s = Sampling()
    return s.name, float(s.temperature)


def deployment_settings(name: str, manifest: dict) -> dict:
    """{"base_strategy", "k", "top_k_candidates"} of one served name (module docstring)."""
    manifest = manifest or {}
    info = (manifest.get("variants") or {}).get(name)
    forced = mn.parse_acceptance_length(name)
    if isinstance(info, dict):
        return {BASE_STRATEGY: info.get("base_strategy") or name, K: info.get("k"),
                CANDIDATES: info.get("top_k_candidates"),
                SYNTHETIC_AL: info.get("synthetic_acceptance_length", forced)}
    parsed = mn.parse_variant_name(name)
    base, k, c = parsed if parsed else (name, None, None)
    if k is None:
        mem = (manifest.get("memory") or {}).get(name) or {}
        k = mem.get("num_speculative_tokens")
    if k is None and base == mn.AUTOREGRESSIVE:
        k = 0
    return {BASE_STRATEGY: base, K: k, CANDIDATES: c, SYNTHETIC_AL: forced}


def request_category(df: pd.DataFrame) -> pd.Series:
    """Per request its prompt's category: the ``category`` column, else (rows before schema 8,
    or prompts without one) the built-in prompt set's (``metric_names.PROMPT_SET_CATEGORY`` by
    the prompt id's ``<set>/`` prefix or the dataset), else null."""
    def col(name: str) -> list:
        return df[name].tolist() if name in df.columns else [None] * len(df)

    out = []
    for cat, pid, ds in zip(col(mn.REQ_CATEGORY), col(mn.REQ_PROMPT_ID), col(mn.REQ_DATASET)):
        if isinstance(cat, str) and cat.strip():
            out.append(cat)
        elif isinstance(pid, str) and "/" in pid:
            out.append(mn.PROMPT_SET_CATEGORY.get(pid.split("/", 1)[0]))
        else:
            out.append(mn.PROMPT_SET_CATEGORY.get(ds) if isinstance(ds, str) else None)
    return pd.Series(out, index=df.index, dtype=object)


def add_dimensions(requests: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    """Copy of one run's request rows with ``sampling``, ``temperature``, ``ignore_eos``,
    ``min_tokens``, ``base_strategy``, ``k``, ``top_k_candidates`` and
    ``synthetic_acceptance_length`` (NaN: a real deployment) filled in."""
    df = requests.copy()
    label, temp = profile_sampling(manifest)
    if mn.REQ_SAMPLING not in df.columns:
        df[mn.REQ_SAMPLING] = None
    df[mn.REQ_SAMPLING] = df[mn.REQ_SAMPLING].fillna(label).astype(str)
    if mn.REQ_TEMPERATURE not in df.columns:
        df[mn.REQ_TEMPERATURE] = np.nan
    df[mn.REQ_TEMPERATURE] = pd.to_numeric(df[mn.REQ_TEMPERATURE], errors="coerce")
    df.loc[df[mn.REQ_TEMPERATURE].isna() & df[mn.REQ_SAMPLING].eq(label), mn.REQ_TEMPERATURE] = temp
    df[mn.REQ_IGNORE_EOS] = (pd.to_numeric(df[mn.REQ_IGNORE_EOS], errors="coerce").fillna(0).astype(int)
                             if mn.REQ_IGNORE_EOS in df.columns else 0)
    if mn.REQ_MIN_TOKENS not in df.columns:
        df[mn.REQ_MIN_TOKENS] = np.nan
    settings = {n: deployment_settings(n, manifest) for n in df[mn.REQ_STRATEGY].dropna().unique()}
    for col in (BASE_STRATEGY, K, CANDIDATES, SYNTHETIC_AL):
        df[col] = df[mn.REQ_STRATEGY].map(lambda n, c=col: settings.get(n, {}).get(c))
    df[mn.REQ_CATEGORY] = request_category(df)
    for col in (K, CANDIDATES, SYNTHETIC_AL):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df


def sampling_labels(frame: pd.DataFrame) -> list[str]:
    """The sampling labels of a frame, ``greedy`` first, then by temperature, then by name."""
    if frame.empty or mn.REQ_SAMPLING not in frame.columns:
        return []
    temps = (frame.groupby(mn.REQ_SAMPLING)[mn.REQ_TEMPERATURE].first()
             if mn.REQ_TEMPERATURE in frame.columns else pd.Series(dtype=float))
    return sorted(frame[mn.REQ_SAMPLING].dropna().unique(),
                  key=lambda s: (s != mn.GREEDY, float(temps.get(s, np.nan))
                                 if pd.notna(temps.get(s, np.nan)) else np.inf, s))


def primary_sampling(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of the first sampling label (``sampling_labels``): figures over users levels
    that draw one line per strategy show this setting only."""
    labels = sampling_labels(frame)
    return frame[frame[mn.REQ_SAMPLING].eq(labels[0])] if len(labels) > 1 else frame


def with_sampling(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``sampling`` column (``greedy`` where absent or null), so a frame
    built without ``analysis.data.load`` (older callers, tests) groups by ``CELL_KEY``.
    Returns ``frame`` itself when nothing is missing, else a copy."""
    if mn.REQ_SAMPLING in frame.columns and not frame[mn.REQ_SAMPLING].isna().any():
        return frame
    df = frame.copy()
    df[mn.REQ_SAMPLING] = (df[mn.REQ_SAMPLING].fillna(mn.GREEDY) if mn.REQ_SAMPLING in df.columns
                           else mn.GREEDY)
    return df


def is_synthetic(df: pd.DataFrame) -> pd.Series:
    """Per row of a request or cell table: True for a forced-acceptance deployment
    (``synthetic_acceptance_length`` set, else a ``-al<A>`` served name)."""
    if df.empty or mn.REQ_STRATEGY not in df.columns:
        return pd.Series(False, index=df.index)
    by_name = df[mn.REQ_STRATEGY].map(lambda n: mn.parse_acceptance_length(str(n)) is not None)
    if SYNTHETIC_AL in df.columns:
        by_name = by_name | pd.to_numeric(df[SYNTHETIC_AL], errors="coerce").notna()
    return by_name.astype(bool)


def real_only(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of real deployments: forced-acceptance ones (``is_synthetic``) left out, as
    every recommendation must (their text is not the target's)."""
    return df[~is_synthetic(df)] if not df.empty else df
