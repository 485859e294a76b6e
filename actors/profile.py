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

A strategy served by vLLM's engine (``engine.backend: vllm``) is profiled on that engine,
in the vLLM venv's python (``python -m actors.engine.vllm_backend`` with phases, one engine
load; ``_profile_vllm_strategy``): vLLM runs schedule, forward, sampling and its proposer as
one step and exposes no forward of its own, so its ``forward`` points are whole decode-only
steps at batch B and context ctx (``tokens_per_row`` 1: the verify width is not profiled
apart; its ``engine_steps`` carry the measured one), after an untimed warm-up at every
batch; ``prefill`` is the median prefill step of ``repeats`` one-token requests. The entry
says ``"backend": "vllm"``; ``analysis.model.profiled.profile_applies`` matches it to a
run's vLLM-backed strategy only.
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
PROFILED_BACKENDS = ("embedded", "vllm")   # engine.backend values this module profiles
VLLM_TIMEOUT_S = 900.0   # one vLLM strategy's profile: engine load (~60 s on 2 cores) + steps


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
            if eng.get("strategy") and (eng.get("backend") or "embedded") in PROFILED_BACKENDS:
                found.setdefault(e.get("name") or eng["strategy"], resolve_engine_config(eng))
    if strategies:
        bad = [s for s in strategies if s not in found]
        if bad:
            raise ValueError(f"strategies {bad} are not strategies of {path} with an engine "
                             f"this machine runs ({'/'.join(PROFILED_BACKENDS)}); it has "
                             f"{sorted(found)}")
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


class _HFTokens:
    """``encode`` of a Hugging Face tokenizer without special tokens (``_prompt_ids``'s API)."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_dir)
        self._tok.model_max_length = 1 << 30   # the corpus is encoded whole, then cut

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


def _vllm_phases(tokens, batches, step_contexts, prefill, max_tokens: int, repeats: int = 3
                 ) -> list[dict]:
    """The fixed-batch phases of a vLLM profile, in order: an untimed warm-up at every batch
    (the first profile without one: 15.4 ms a step at B = 1, ctx 64, the first point, where
    B = 2 took 6.3 ms); per context x batch, B requests of a ctx-token prompt run together to
    ``max_tokens`` (ignore_eos, greedy), the grid twice, the second pass in reverse order (a
    machine that slows or speeds up during the profile then bends no end of the grid: the
    main job's profile, taken while its service idled, had every ctx-64 point, the first
    half, up to 1.7x the ctx-256 ones at B <= 8; alone on the box 0.94-1.14x); then
    ``repeats`` requests one after another per prefill length P with one output token (each
    one prefill step)."""
    short = min(step_contexts)
    phases = [{"kind": "warmup", "batch_size": b, "requests": [
        [f"warmup-{b}-{i}", ids, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}]
        for i, ids in enumerate(_prompt_ids(tokens, short, b))]} for b in batches]
    grid = [(b, ctx) for ctx in step_contexts for b in batches]
    for n, (b, ctx) in enumerate(grid + grid[::-1]):     # two passes, the second reversed
        phases.append({"kind": "steps", "batch_size": b, "context_len": ctx, "requests": [
            [f"profile-{b}-{ctx}-{i}-{n}", ids, {"max_tokens": max_tokens, "temperature": 0.0,
                                                 "ignore_eos": True}]
            for i, ids in enumerate(_prompt_ids(tokens, ctx, b))]})
    prompts = _prompt_ids(tokens, max(prefill), repeats)
    for p in prefill:
        phases.append({"kind": "prefill", "batch_size": 1, "prefill_tokens": p, "requests": [
            [f"profile-prefill-{p}-{i}", ids[:p], {"max_tokens": 1, "temperature": 0.0,
                                                   "ignore_eos": True}]
            for i, ids in enumerate(prompts)]})
    return phases


def _vllm_points(phases: list[dict], answered: list[dict]) -> tuple[list, list, list]:
    """(forward, prefill, engine_steps) points from the vLLM engine's step rows per phase.
    vLLM runs schedule + forward + sample + the proposer as one step, so a forward point is
    the whole decode-only step at batch B and context ctx (``tokens_per_row`` 1: the profile
    does not split the verify width; the run's step log scales it, ``calibrate``); an
    engine-steps point the same step with its measured tokens per row (``draft_ms`` 0: vLLM
    does not time its proposer apart)."""
    fwd, pre, steps = [], [], []
    by_point: dict[tuple[int, int], list[dict]] = {}     # (B, ctx) -> decode rows, both passes
    for ph, got in zip(phases, answered):
        rows = got.get("steps") or []
        if ph["kind"] == "warmup":
            continue
        if ph["kind"] == "prefill":
            done = [r for r in rows if r["prefill_tokens"] >= ph["prefill_tokens"]]
            if done:
                pre.append({"prefill_tokens": ph["prefill_tokens"],
                            "step_ms": statistics.median(r["step_ms"] for r in done),
                            "cpu_ms": statistics.median(r["cpu_ms"] for r in done)})
            continue
        b, ctx = ph["batch_size"], ph["context_len"]
        by_point.setdefault((b, ctx), []).extend(
            r for r in rows if r["batch_size"] == b and not r["prefill_tokens"])
    for (b, ctx), dec in by_point.items():
        if not dec:
            continue
        med = lambda k: statistics.median(float(r[k] or 0.0) for r in dec)  # noqa: E731
        fwd.append({"batch_size": b, "tokens_per_row": 1, "context_len": ctx,
                    "step_ms": med("step_ms"), "cpu_ms": med("cpu_ms"), "batch_tokens": b})
        steps.append({"batch_size": b, "context_len": ctx,
                      "tokens_per_row": statistics.median(r["verification_tokens"] / b for r in dec),
                      "context_per_row": statistics.median(r["context_tokens"] / b for r in dec),
                      "draft_ms": 0.0, "verify_ms": med("verify_ms"), "step_ms": med("step_ms"),
                      "overhead_ms": statistics.median(max(0.0, r["step_ms"] - r["verify_ms"])
                                                       for r in dec),
                      "cpu_ms": med("cpu_ms"), "steps": len(dec)})
    return fwd, pre, steps


def _profile_vllm_strategy(name: str, eng_cfg: dict, out: dict, batches, prefill, step_contexts,
                           max_tokens: int, repeats: int, log, timeout_s: float = VLLM_TIMEOUT_S
                           ) -> None:
    """One vLLM-backed strategy's profile (``_vllm_phases`` in the vLLM venv's python, one
    engine load: ``python -m actors.engine.vllm_backend``) under ``out["strategies"][name]``.
    Raises ValueError when the vLLM python is missing or the engine fails (its stderr's
    last line)."""
    import subprocess

    from actors.engine.config import EngineConfig
    from actors.engine.vllm_backend import REPO_ROOT, default_vllm_python, vllm_env

    t0 = time.perf_counter()
    python = eng_cfg.get("vllm_python") or default_vllm_python()
    if not Path(python).is_file():
        raise ValueError(f"{name}: the vLLM python {python} is missing (engine.vllm_python, "
                         f"$SPECLOAD_VLLM_PYTHON)")
    # no prefix cache: the prefill points are prefixes of one prompt
    cfg = EngineConfig(**{**eng_cfg, "served_model_name": name, "enable_prefix_caching": False,
                          "max_num_seqs": max(int(eng_cfg.get("max_num_seqs", 1)), max(batches))}
                       ).model_dump()
    phases = _vllm_phases(_HFTokens(cfg["model"]), batches, step_contexts, prefill, max_tokens,
                          repeats)
    spec = {"config": cfg, "phases": [{"requests": ph["requests"], "batch_size": ph["batch_size"]}
                                      for ph in phases]}
    done = subprocess.run([python, "-m", "actors.engine.vllm_backend"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT,
                          env=vllm_env())
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{name}: the vLLM engine failed (exit {done.returncode}): {tail[0][:300]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    fwd, pre, steps = _vllm_points(phases, answer["phases"])
    out["strategies"][name] = {
        "strategy": eng_cfg["strategy"], "backend": "vllm",
        "engine": {k: v for k, v in cfg.items() if isinstance(v, (str, int, float, bool))},
        "num_speculative_tokens": int(eng_cfg.get("num_speculative_tokens") or 0)
        if eng_cfg["strategy"] != "autoregressive" else 0,
        "forward": fwd, "prefill": pre, "engine_steps": steps, "load_s": answer.get("load_s")}
    log(f"engine profile: {name} in {time.perf_counter() - t0:.1f} s: {len(fwd)} forward, "
        f"{len(pre)} prefill, {len(steps)} engine-step points (vLLM, engine load "
        f"{answer.get('load_s') or 0:.0f} s); "
        + ", ".join(f"B={s['batch_size']}/ctx={s['context_len']}: step {s['step_ms']:.2f} ms"
                    for s in steps[:4]))


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
        if (eng_cfg.get("backend") or "embedded") == "vllm":
            _profile_vllm_strategy(name, eng_cfg, out, batches, prefill, step_contexts,
                                   max_tokens, repeats, log)
            continue
        _profile_strategy(name, eng_cfg, out, batches, tokens_per_row, contexts, prefill,
                          step_contexts, repeats, max_tokens, log)
    if "points" not in out:    # vLLM strategies only: their step grid
        out["points"] = next(iter(out["strategies"].values()), {}).get("forward", [])
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
                                 description="Profile the engine's step cost per strategy of a "
                                             "Serve config (embedded: decode forward grid, "
                                             "prefill, whole engine steps; vLLM: whole engine "
                                             "steps at fixed batches, prefill); write it beside "
                                             "a run as RUN_DIR/cost_curve.json.")
    add_config_flags(ap)
    ap.add_argument("--skip-missing", action="store_true",
                    help="skip --strategies the config has no embedded or vLLM engine for (a "
                         "variant, another backend) instead of failing")
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
            print("engine profile: none of --strategies has an embedded or vLLM engine in the "
                  "config",
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
