"""``--k`` / ``--top-k-candidates`` / ``--acceptance-length``: the deployments a run drives,
one per strategy x k x candidates x forced acceptance length (``metric_names.variant_name``).
Without ``--target`` the local service's Serve config is rewritten with them; with
``--target`` they must be served there already."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from configs import metric_names as M
from loadgen.cli.args import FlagError
from loadgen.run import service


def resolve_variants(args: argparse.Namespace) -> dict[str, dict]:
    """``--k`` / ``--top-k-candidates`` / ``--acceptance-length``: served name ->
    {"base_strategy", "strategy", "k", "top_k_candidates", "synthetic_acceptance_length",
    "synthetic", "engine"} of every deployment to drive ({} without those flags).

    Without ``--target`` the local service's Serve config is rewritten with the variants
    (``_local_variants``); with ``--target`` the variants of the ``--strategies`` names must
    already be served there (``_target_variants``). ``args.strategies`` becomes the variant
    names (``args.base_strategies`` keeps what was asked). Raises FlagError naming the flag
    (a k over a block drafter's block size names ``--k``)."""
    als = getattr(args, "acceptance_length", None)
    if not (args.k or args.top_k_candidates or als):
        return {}
    asked = [x.strip() for x in args.strategies.split(",") if x.strip()]
    flag = "--k" if args.k else "--top-k-candidates" if args.top_k_candidates else "--acceptance-length"
    if args.target:
        variants = _target_variants(args, asked, als, flag)
    else:
        variants = _local_variants(args, asked, als, flag)
    args.base_strategies = args.strategies
    args.strategies = ",".join(variants)
    return variants


def _target_variants(args: argparse.Namespace, asked: list[str], als: list[float] | None,
                     flag: str) -> dict[str, dict]:
    """With ``--target``: one entry per asked strategy x k x candidates x forced acceptance
    (``metric_names.variant_name``), autoregressive once. Raises FlagError: no names asked,
    an acceptance length above k + 1, or nothing that speculates with ``--acceptance-length``."""
    if not asked:
        raise FlagError(flag, "with --target, name the strategies (--strategies a,b): their "
                               "variants (<strategy>-k<K>) must be served there")
    over = [k for k in (args.k or []) if als and max(als) > k + 1]
    variants: dict[str, dict] = {}
    for name in asked:
        parsed = M.parse_variant_name(name)
        strategy = parsed[0] if parsed else name
        if strategy == M.AUTOREGRESSIVE:
            variants[name] = {"base_strategy": name, "strategy": strategy, "k": 0,
                              "top_k_candidates": None, "synthetic_acceptance_length": None,
                              "synthetic": False, "engine": None}
            continue
        if over:
            raise FlagError("--acceptance-length", f"{max(als):g} above k + 1 for k = {over}; a "
                             "step of k drafts emits at most k + 1 tokens")
        cands = (args.top_k_candidates if args.top_k_candidates and strategy in M.CANDIDATE_STRATEGIES
                 else [None])
        for k in args.k or [None]:
            for c in cands:
                for a in als or [None]:
                    variants[M.variant_name(name, k, c, a)] = {
                        "base_strategy": name, "strategy": strategy, "k": k,
                        "top_k_candidates": c, "synthetic_acceptance_length": a,
                        "synthetic": a is not None, "engine": None}
    if als and not any(v["synthetic"] for v in variants.values()):
        raise FlagError("--acceptance-length", "no selected strategy speculates (autoregressive "
                         "has no accept decision to force); add a speculative one to --strategies")
    return variants


def _local_variants(args: argparse.Namespace, asked: list[str], als: list[float] | None,
                    flag: str) -> dict[str, dict]:
    """Without ``--target``: the local service's Serve config (``--local-config``, default
    ``configs/serve.yaml``) rewritten with the variants (``configs.serve_config.variant_config``:
    one deployment per strategy x k x candidates, autoregressive kept as the baseline), saved to
    a temp file that ``args.local_config`` then names. Raises FlagError naming the flag the
    config check refused."""
    import hashlib
    import tempfile

    import yaml

    from configs.paths import CONFIGS_DIR
    from configs.serve_config import VariantError, variant_config

    base = Path(args.local_config or CONFIGS_DIR / "serve.yaml")
    try:
        cfg, variants = variant_config(yaml.safe_load(base.read_text()), asked, args.k,
                                       args.top_k_candidates, als)
    except VariantError as err:
        bad, _, msg = str(err).partition(": ")
        raise FlagError(bad, msg) from None
    text = (f"# generated by python -m loadgen from {base} with --k {args.k} "
            f"--top-k-candidates {args.top_k_candidates} --acceptance-length {als}\n"
            + yaml.safe_dump(cfg, sort_keys=False))
    path = Path(tempfile.gettempdir()) / (
        f"specload-variants-{os.getuid()}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml")
    path.write_text(text)
    try:
        service.check_serve_config(path)
    except ValueError as err:
        if als and ("rejection_sample_method" in str(err) or "synthetic_acceptance" in str(err)):
            flag = "--acceptance-length"   # the forced acceptance is what the engine refused
        raise FlagError(flag, f"the variants' Serve config does not validate: {err}") from None
    args.local_config = str(path)
    return variants
