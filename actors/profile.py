"""The engine profile: the embedded engine's own step cost, measured per strategy of a
Serve config (``python -m actors.profile --out RUN_DIR/cost_curve.json``; the main job
takes it after its cells, ``python -m loadgen --engine-profile``; ``python -m
bench.step_cost --engine`` is the same with the benchmark's grid flags).

Per strategy one ``LLMEngine`` is built as a replica builds it, and three parts are timed
apart (``profile_engine``): the decode forward of the target (``engine.runner.run``, the
verify forward: batch rows x tokens per row x context length, the hidden states the
strategy's drafter reads included), the prefill forward (one prompt chunk of P tokens from
position 0, last logits only), and whole engine steps at a fixed batch (B requests of a
context-length prompt run together; decode-only steps at batch B: the drafter's
``draft_ms``, the engine's ``verify_ms`` with the acceptance, ``step_ms`` and the
verification tokens per row it really ran). Units: ms (wall and this thread's CPU time),
rows, tokens.

The file keeps the grid-file keys of ``bench.step_cost`` (``shape``, ``device``,
``points`` = the first strategy's decode grid), so ``analysis plan --cost-curve`` reads it
too, and adds ``"kind": "engine_profile"`` and ``"strategies": {name: {"engine",
"num_speculative_tokens", "forward": [...], "prefill": [...], "engine_steps": [...]}}``;
the capacity model (``analysis.model.profiled``) interpolates it and calibrates it on a
run's step log. This is the operator profiling of Vidur (Agrawal et al., MLSys 2024,
section 4) on the engine that serves the run, the verify width K + 1 inside the profiled
tokens per row as in BLIS (Bhandari et al., 2025).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from actors.engine.runner import RowInput
from configs.jsonio import write_json

EMBEDDED = "embedded"   # the committed target, models/target/config.json


ENGINE_BATCHES = (1, 2, 4, 8, 16, 32)
ENGINE_TOKENS_PER_ROW = (1, 2, 4, 8)
ENGINE_CONTEXTS = (64, 192, 384)
ENGINE_PREFILL = (16, 64, 256)
ENGINE_STEP_CONTEXTS = (64, 256)
PROFILE_KIND = "engine_profile"


def _prompt_ids(tokenizer, n_tokens: int, n_prompts: int) -> list[list[int]]:
    """``n_prompts`` prompts of exactly ``n_tokens`` ids, cut from the committed prompt sets
    (data/prompts/*.jsonl, the text the load generator sends), each starting elsewhere."""
    from configs.paths import REPO_ROOT

    text = []
    for f in sorted((REPO_ROOT / "data" / "prompts").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines()[:400]:
            try:
                text.append(json.loads(line)["prompt"])
            except (ValueError, KeyError):
                continue
    ids = tokenizer.encode("\n".join(text) or "def f(x):\n    return x\n")
    while len(ids) < n_tokens * (n_prompts + 1):
        ids = ids + ids
    stride = max(1, (len(ids) - n_tokens) // max(n_prompts, 1))
    return [[t if t != 0 else 1 for t in ids[i * stride:i * stride + n_tokens]]
            for i in range(n_prompts)]


def _engine_configs(serve_config: Path | None, strategies: list[str] | None) -> dict[str, dict]:
    """{strategy name: engine dict} of the Serve config (model paths made absolute, as a
    replica resolves them). Raises ValueError naming the config's strategies for an
    unknown one."""
    import yaml

    from actors.serve.app import resolve_engine_config
    from configs.paths import CONFIGS_DIR

    path = serve_config or CONFIGS_DIR / "serve.yaml"
    cfg = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    found: dict[str, dict] = {}
    for app in cfg.get("applications") or []:
        for e in (app.get("args") or {}).get("strategies") or []:
            eng = dict(e.get("engine") or {})
            if eng.get("strategy") and (eng.get("backend") or "embedded") == "embedded":
                found.setdefault(e.get("name") or eng["strategy"], resolve_engine_config(eng))
    if strategies:
        bad = [s for s in strategies if s not in found]
        if bad:
            raise ValueError(f"strategies {bad} are not embedded-engine strategies of {path}; "
                             f"it has {sorted(found)}")
        found = {s: found[s] for s in strategies}
    return found


def _engine_steps(engine, batch: int, ctx: int, max_tokens: int, log) -> dict | None:
    """Run ``batch`` requests of a ``ctx``-token prompt together to ``max_tokens`` output
    tokens each (ignore_eos, greedy); the medians over the decode-only steps at batch
    ``batch``: {"batch_size", "context_len", "tokens_per_row" (verification tokens per
    row), "draft_ms", "verify_ms", "step_ms", "overhead_ms" (step - draft - verify),
    "cpu_ms", "steps"}; None when no such step ran."""
    from actors.engine.types import SamplingParams

    rows: list[dict] = []
    engine.on_step = rows.append
    for i, ids in enumerate(_prompt_ids(engine.tokenizer, ctx, batch)):
        engine.add_request(f"profile-{batch}-{ctx}-{i}", ids,
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    guard = 0
    while engine.has_unfinished_requests() and guard < 100 * max_tokens:
        engine.step()
        guard += 1
    engine.on_step = None
    dec = [r for r in rows if r["batch_size"] == batch and not r["prefill_tokens"]]
    if not dec:
        return None
    med = lambda k: statistics.median(float(r[k] or 0.0) for r in dec)  # noqa: E731
    return {"batch_size": batch, "context_len": ctx,
            "tokens_per_row": statistics.median(r["verification_tokens"] / batch for r in dec),
            "context_per_row": statistics.median(r["context_tokens"] / batch for r in dec),
            "draft_ms": med("draft_ms"), "verify_ms": med("verify_ms"), "step_ms": med("step_ms"),
            "overhead_ms": statistics.median(max(0.0, r["step_ms"] - r["draft_ms"] - r["verify_ms"])
                                             for r in dec),
            "cpu_ms": med("cpu_ms"), "steps": len(dec)}


def _forward_points(engine, contexts, batches, tokens_per_row, repeats: int) -> list[dict]:
    """One timed ``ModelRunner.run`` per context x batch x tokens per row (all logits, as a
    verify step asks): {"batch_size", "tokens_per_row", "context_len", "step_ms", "cpu_ms",
    "batch_tokens"} (medians of ``repeats``)."""
    aux = engine.aux_layers
    fwd = []
    with torch.inference_mode():
        for ctx in contexts:
            for b in batches:
                for q in tokens_per_row:
                    rows = [RowInput(slot=i, start=ctx,
                                     token_ids=[(7 * i + j) % 97 + 1 for j in range(q)])
                            for i in range(b)]
                    ms, cpu = _time_call(lambda: engine.runner.run(rows, aux_layers=aux), repeats)
                    fwd.append({"batch_size": b, "tokens_per_row": q, "context_len": ctx,
                                "step_ms": statistics.median(ms), "cpu_ms": statistics.median(cpu),
                                "batch_tokens": b * q})
    return fwd


def _prefill_points(engine, prefill, repeats: int) -> list[dict]:
    """One timed one-row prefill (last logits only) per length of ``prefill``:
    {"prefill_tokens", "step_ms", "cpu_ms"}."""
    aux = engine.aux_layers
    pre = []
    ids = _prompt_ids(engine.tokenizer, max(prefill), 1)[0]
    with torch.inference_mode():
        for p in prefill:
            rows = [RowInput(slot=0, start=0, token_ids=ids[:p])]
            ms, cpu = _time_call(lambda: engine.runner.run(rows, last_only=True, aux_layers=aux),
                                 repeats)
            pre.append({"prefill_tokens": p, "step_ms": statistics.median(ms),
                        "cpu_ms": statistics.median(cpu)})
    return pre


def _profile_strategy(name: str, eng_cfg: dict, out: dict, batches, tokens_per_row, contexts,
                      prefill, step_contexts, repeats: int, max_tokens: int, log) -> None:
    """Load one strategy's engine and put its forward, prefill and engine-step points under
    ``out["strategies"][name]``. Raises ValueError for a context beyond max_model_len."""
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    eng_cfg = {**eng_cfg, "max_num_seqs": max(int(eng_cfg.get("max_num_seqs", 1)), max(batches))}
    engine = LLMEngine(EngineConfig(**eng_cfg))
    out["device"] = str(engine.device)
    mc = engine.model.config
    if max(max(contexts) + max(tokens_per_row), max(prefill),
           max(step_contexts) + max_tokens + 16) > engine.max_model_len:
        raise ValueError(f"--contexts: a context beyond the engine's max_model_len "
                         f"{engine.max_model_len}")
    fwd = _forward_points(engine, contexts, batches, tokens_per_row, repeats)
    pre = _prefill_points(engine, prefill, repeats)
    steps = [r for ctx in step_contexts for b in batches
             if (r := _engine_steps(engine, b, ctx, max_tokens, log)) is not None]
    out["strategies"][name] = {
        "strategy": eng_cfg["strategy"], "engine": {k: v for k, v in eng_cfg.items()
                                                    if isinstance(v, (str, int, float, bool))},
        "num_speculative_tokens": engine.num_speculative_tokens,
        "forward": fwd, "prefill": pre, "engine_steps": steps}
    out.setdefault("config", {f: getattr(mc, f, None) for f in ("hidden_size", "num_hidden_layers",
                                                                 "vocab_size")})
    if "points" not in out:
        out["points"] = fwd
    log(f"engine profile: {name} in {time.perf_counter() - t0:.1f} s: {len(fwd)} forward, "
        f"{len(pre)} prefill, {len(steps)} engine-step points; "
        + ", ".join(f"B={s['batch_size']}/ctx={s['context_len']}: draft {s['draft_ms']:.2f} "
                    f"verify {s['verify_ms']:.2f} step {s['step_ms']:.2f} ms" for s in steps[:4]))
    del engine


def profile_engine(strategies: list[str] | None = None, serve_config: Path | None = None,
                   batches=ENGINE_BATCHES, tokens_per_row=ENGINE_TOKENS_PER_ROW,
                   contexts=ENGINE_CONTEXTS, prefill=ENGINE_PREFILL,
                   step_contexts=ENGINE_STEP_CONTEXTS, repeats: int = 3, max_tokens: int = 64,
                   threads: int = 1, log=print) -> dict:
    """The engine profile (module doc) of each strategy of the Serve config.

    Units: ms; batch rows; tokens. Every forward point is the median of ``repeats`` timed
    calls after one untimed one (wall and this thread's CPU time). Raises ValueError for a
    strategy the config lacks or a context beyond the model's length."""
    torch.set_num_threads(threads)
    configs = _engine_configs(serve_config, strategies)
    out: dict = {"kind": PROFILE_KIND, "shape": EMBEDDED, "device": "cpu", "torch": torch.__version__,
                 "threads": torch.get_num_threads(), "repeats": repeats, "random_weights": False,
                 "strategies": {}}
    for name, eng_cfg in configs.items():
        _profile_strategy(name, eng_cfg, out, batches, tokens_per_row, contexts, prefill,
                          step_contexts, repeats, max_tokens, log)
    return out


def _time_call(fn, repeats: int) -> tuple[list[float], list[float]]:
    """(wall ms, this thread's CPU ms) of ``repeats`` calls of ``fn`` after one untimed call."""
    wall, cpu = [], []
    for k in range(repeats + 1):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        if k:
            wall.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.thread_time() - c) * 1e3)
    return wall, cpu


def add_config_flags(ap: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--strategies`` and ``--serve-config``: which engines of which Serve config are
    profiled (``prefix`` starts their help, e.g. "--engine: ")."""
    ap.add_argument("--strategies", default="",
                    help=f"{prefix}comma-separated strategies (default: every embedded one of "
                         "the config)")
    ap.add_argument("--serve-config", type=Path, default=None,
                    help=f"{prefix}the Serve config whose engines are profiled (default "
                         "configs/serve.yaml)")


def main(argv: list[str] | None = None) -> int:
    """``python -m actors.profile [--strategies a,b] [--serve-config F] --out FILE``: exit 0,
    or 2 with the flag named (an unknown strategy, a context beyond the model)."""
    ap = argparse.ArgumentParser(prog="python -m actors.profile",
                                 description="Profile the embedded engine's step cost per strategy "
                                             "of a Serve config (decode forward grid, prefill, "
                                             "whole engine steps); write it beside a run as "
                                             "RUN_DIR/cost_curve.json.")
    add_config_flags(ap)
    ap.add_argument("--skip-missing", action="store_true",
                    help="skip --strategies the config has no embedded engine for (a vLLM "
                         "backend, a variant) instead of failing")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per point (median; "
                    "default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", type=Path, required=True, help="profile file to write (JSON)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    names = [x for x in a.strategies.split(",") if x] or None
    if names and a.skip_missing:
        known = _engine_configs(a.serve_config, None)
        names = [x for x in names if x in known]
        if not names:
            print("engine profile: none of --strategies has an embedded engine in the config",
                  file=sys.stderr)
            return 0
    try:
        prof = profile_engine(names, a.serve_config,
                              repeats=a.repeats, threads=a.threads,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    except ValueError as exc:
        ap.error(f"--strategies/--serve-config: {exc}")
    write_json(a.out, prof)
    print(f"engine profile: {a.out} ({len(prof['strategies'])} strategies)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
