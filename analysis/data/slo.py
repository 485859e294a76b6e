"""Which SLO each tier is judged against, and where it came from.

The type and the defaults are ``configs.tiers.Slo`` / ``DEFAULT_*_MS``.

Resolution order, per tier: explicit CLI flags (``--slo-ttft-ms`` /
``--slo-tpot-ms``) > the run manifest's ``config.slo[tier]`` > the defaults
below. Flags win because a user who types a number expects it to be used; the
source of every tier's SLO is printed in the report.
"""

from __future__ import annotations

from configs.tiers import DEFAULT_TPOT_MS, DEFAULT_TTFT_MS, Slo


def resolve_slos(tiers: list[str], manifest_config: dict, ttft_ms: float | None = None,
                 tpot_ms: float | None = None) -> dict[str, Slo]:
    """One ``Slo`` per tier. A flag given alone overrides only its own field.

    ``manifest_config["slo"]`` is ``{tier: {"ttft_ms": x, "tpot_ms": y}}``; a
    ``manifest_config["tiers"][tier]["slo"]`` of the same shape is read too.
    """
    config = manifest_config or {}
    from_manifest = config.get("slo") or {}
    tier_configs = config.get("tiers") if isinstance(config.get("tiers"), dict) else {}
    out: dict[str, Slo] = {}
    for tier in tiers:
        # config.slo[tier], or a tier file's own section config.tiers[tier].slo
        base = from_manifest.get(tier) or ((tier_configs.get(tier) or {}).get("slo") or {})
        source = "manifest" if base else "default"
        ttft = base.get("ttft_ms", DEFAULT_TTFT_MS)
        tpot = base.get("tpot_ms", DEFAULT_TPOT_MS)
        if ttft_ms is not None or tpot_ms is not None:
            source = "flags" if (ttft_ms is not None and tpot_ms is not None) else f"flags+{source}"
        out[tier] = Slo(ttft_ms=ttft_ms if ttft_ms is not None else ttft,
                        tpot_ms=tpot_ms if tpot_ms is not None else tpot, source=source)
    return out
