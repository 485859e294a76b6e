"""Measured step cost curves of real model sizes, no download:
``python -m bench.step_cost --shape qwen3-4b --random-weights [--device cuda] --out F.json``.

A step's cost does not depend on the weight values, so the model is built
from its published config (``SHAPES``, numbers copied from each model's HF
``config.json``) with random weights, and the engine's own batched verification
forward (``actors.engine.runner.ModelRunner.run``: padded rows, logits for every
verified token, KV cache read up to each row's context) is timed over a grid of
batch size x tokens per row (1, 2, 4, 8, 16 verification tokens) x context length.
Each point is the median of ``--repeats`` timed forwards after one warm-up
(``torch.cuda.synchronize`` around each on a GPU).

Output (strict JSON): ``{"shape", "device", "dtype", "config", "torch",
"threads", "points": [{"batch_size", "tokens_per_row", "context_len",
"step_ms", "step_ms_p90", "cpu_ms", "batch_tokens"}]}`` (cpu_ms: the thread's CPU
time on a CPU device, None on a GPU), read by ``python -m analysis
plan --cost-curve FILE``.

Engine profile (``--engine``, the embedded target's real checkpoints and the Serve
config's strategies): ``python -m bench.step_cost --engine [--strategies a,b]
--out RUN_DIR/cost_curve.json``. Per strategy of ``configs/serve.yaml`` (or
``--serve-config``) one ``LLMEngine`` is built as a replica builds it, and three parts
are timed apart (``profile_engine``): the decode forward of the target
(``engine.runner.run``, the verify forward: batch rows x tokens per row x context
length, the hidden states the strategy's drafter reads included), the prefill forward
(one prompt chunk of P tokens from position 0, last logits only), and whole engine
steps at a fixed batch (B requests of a context-length prompt run together; decode-only
steps at batch B: the drafter's ``draft_ms``, the engine's ``verify_ms`` with the
acceptance, ``step_ms`` and the verification tokens per row it really ran). The file
keeps the grid-file keys (``shape``, ``device``, ``points`` = the first strategy's
decode grid), so ``plan --cost-curve`` reads it too, and adds ``"kind":
"engine_profile"`` and ``"strategies": {name: {"engine", "num_speculative_tokens",
"forward": [...], "prefill": [...], "engine_steps": [...]}}``; the capacity model
(``analysis.model.profiled``) interpolates it and calibrates it on a run's step log.
This is the operator profiling of Vidur (Agrawal et al., MLSys 2024, section 4) on the
engine that serves the run, the verify width K + 1 inside the profiled tokens per row
as in BLIS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from actors.engine.model import CausalLM, ModelConfig
from actors.engine.runner import ModelRunner, RowInput
from configs.jsonio import write_json
from configs.paths import MODELS_DIR

# Published configs (HF config.json of each model; sizes in elements).
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3-4b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
                 "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "llama-3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False},
    # not a published model: a few-layer shape for CI on a CPU
    "tiny": {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "max_position_embeddings": 4096, "tie_word_embeddings": True},
}
EMBEDDED = "embedded"   # the committed target, models/target/config.json
TOKENS_PER_ROW = (1, 2, 4, 8, 16)
DEFAULT_BATCHES = {"cpu": (1, 4, 16), "cuda": (1, 4, 16, 64, 128)}
DEFAULT_CONTEXTS = {"cpu": (256,), "cuda": (512, 2048)}


def shape_config(name: str) -> dict:
    """The HF-style config dict of a preset; raises KeyError naming the presets."""
    if name == EMBEDDED:
        return json.loads((MODELS_DIR / "target" / "config.json").read_text())
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; presets: {sorted(SHAPES) + [EMBEDDED]}")
    return dict(SHAPES[name])


def random_model(cfg_dict: dict, device: str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """``CausalLM`` of that config with N(0, 0.02) weights (norms at 1), in eval mode, fused.

    Built on the meta device and materialised with ``to_empty`` so no time goes into
    the default initialisers; every parameter is then filled (no uninitialised
    memory: denormals or NaNs would change CPU timings)."""
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def fuse(model: CausalLM) -> CausalLM:
    model.fuse()
    return model


def time_step(runner: ModelRunner, batch: int, q: int, ctx: int, repeats: int,
              device: str) -> tuple[list[float], list[float]]:
    """``repeats`` timed verification forwards of ``batch`` rows x ``q`` tokens, each
    row attending ``ctx`` cached tokens, after one untimed warm-up: (wall ms, this
    thread's CPU ms). On a shared CPU the CPU time is the cost without waiting for a core."""
    rows = [RowInput(slot=i, start=ctx, token_ids=[(7 * i + j) % 97 + 1 for j in range(q)])
            for i in range(batch)]
    wall, cpu = [], []
    for k in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        runner.run(rows)
        if device == "cuda":
            torch.cuda.synchronize()
        if k:
            wall.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.thread_time() - c) * 1e3)
    return wall, cpu


def measure(shape: str, device: str = "cpu", dtype: str = "auto", batches=None,
            tokens_per_row=TOKENS_PER_ROW, contexts=None, repeats: int = 3,
            threads: int | None = 1, log=print) -> dict:
    """Build the random-weight model and time the grid; returns the curve-file dict.

    Raises KeyError for an unknown shape, ValueError for a context beyond the
    model's max_position_embeddings, RuntimeError when cuda is asked for but absent.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device on this machine")
    if threads:
        torch.set_num_threads(threads)
    cfg = shape_config(shape)
    tdtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32,
              "float32": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16}[dtype]
    batches = tuple(batches or DEFAULT_BATCHES[device])
    contexts = tuple(contexts or DEFAULT_CONTEXTS[device])
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if max(contexts) + max(tokens_per_row) > max_pos:
        raise ValueError(f"context {max(contexts)} + {max(tokens_per_row)} tokens exceeds the "
                         f"shape's max_position_embeddings {max_pos}")
    t0 = time.perf_counter()
    model = fuse(random_model(cfg, device, tdtype))
    runner = ModelRunner(model, num_slots=max(batches), max_len=max(contexts) + max(tokens_per_row))
    log(f"cost-curve: {shape} ({model.num_params() / 1e6:.0f}M params, {tdtype}) on {device}, "
        f"built in {time.perf_counter() - t0:.1f} s; grid {len(batches)} batches x "
        f"{len(tokens_per_row)} tokens/row x {len(contexts)} contexts")
    points = []
    for ctx in contexts:
        for b in batches:
            for q in tokens_per_row:
                ms, cpu = time_step(runner, b, q, ctx, repeats, device)
                ms_sorted = sorted(ms)
                p = {"batch_size": b, "tokens_per_row": q, "context_len": ctx,
                     "step_ms": statistics.median(ms),
                     "step_ms_p90": ms_sorted[min(len(ms) - 1, int(0.9 * len(ms)))],
                     "cpu_ms": statistics.median(cpu) if device == "cpu" else None,
                     "batch_tokens": b * q}
                points.append(p)
                log(f"  B={b:>4} q={q:>2} ctx={ctx:>5}: {p['step_ms']:.2f} ms wall"
                    + (f", {p['cpu_ms']:.2f} ms CPU" if p["cpu_ms"] is not None else ""))
    return {"shape": shape, "device": device, "dtype": str(tdtype).replace("torch.", ""),
            "config": cfg, "num_params": model.num_params(), "torch": torch.__version__,
            "threads": torch.get_num_threads() if device == "cpu" else None,
            "repeats": repeats, "random_weights": True,
            "gpu_name": torch.cuda.get_device_name() if device == "cuda" else None,
            "points": points}


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
                   step_contexts=ENGINE_STEP_CONTEXTS, repeats: int = 3, max_tokens: int = 16,
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


def _ints(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects comma-separated integers, got {text!r}")
        if not vals or min(vals) < 1:
            raise argparse.ArgumentTypeError(f"{flag} needs integers >= 1, got {text!r}")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.step_cost",
                                 description="Time the verification forward of a published model "
                                             "shape with random weights over a batch x tokens grid.")
    ap.add_argument("--shape", choices=sorted(SHAPES) + [EMBEDDED],
                    help="a published model shape (random weights); required unless --engine")
    ap.add_argument("--random-weights", action="store_true",
                    help="build the model from its config with random weights (no download); "
                         "required with --shape")
    ap.add_argument("--engine", action="store_true",
                    help="profile the embedded engine itself, per strategy of --serve-config "
                         "(real checkpoints): decode forward over --batches x --tokens-per-row x "
                         "--contexts, prefill forward, and whole engine steps (the drafter's "
                         "cost apart); write it beside a run as RUN_DIR/cost_curve.json")
    ap.add_argument("--strategies", default="",
                    help="--engine: comma-separated strategies (default: every embedded one)")
    ap.add_argument("--serve-config", type=Path, default=None,
                    help="--engine: the Serve config whose engines are profiled "
                         "(default configs/serve.yaml)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    ap.add_argument("--batches", type=_ints("--batches"), default=None,
                    help="batch sizes (default cpu 1,4,16; cuda 1,4,16,64,128)")
    ap.add_argument("--tokens-per-row", type=_ints("--tokens-per-row"), default=TOKENS_PER_ROW,
                    help="verification tokens per row (default 1,2,4,8,16)")
    ap.add_argument("--contexts", type=_ints("--contexts"), default=None,
                    help="KV context lengths (default cpu 256; cuda 512,2048)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per point (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--out", type=Path, required=True, help="curve file to write (JSON)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.engine:
        try:
            curve = profile_engine(
                [x for x in a.strategies.split(",") if x] or None, a.serve_config,
                a.batches or ENGINE_BATCHES,
                a.tokens_per_row if a.tokens_per_row != TOKENS_PER_ROW else ENGINE_TOKENS_PER_ROW,
                a.contexts or ENGINE_CONTEXTS, repeats=a.repeats, threads=a.threads,
                log=lambda m: print(m, file=sys.stderr, flush=True))
        except ValueError as exc:
            ap.error(f"--strategies/--contexts: {exc}")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(a.out, curve)
        print(f"engine profile: {a.out} ({len(curve['strategies'])} strategies)")
        return 0
    if a.shape is None or not a.random_weights:
        ap.error("--shape NAME --random-weights (or --engine) is required")
    try:
        curve = measure(a.shape, a.device, a.dtype, a.batches, a.tokens_per_row, a.contexts,
                        a.repeats, a.threads, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (RuntimeError, ValueError) as exc:
        ap.error(f"--device/--contexts: {exc}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out, curve)
    print(f"cost curve: {a.out} ({len(curve['points'])} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
