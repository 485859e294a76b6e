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

Engine profile (``--engine``): ``actors.profile.profile_engine`` (the embedded engine's
own step cost per strategy of a Serve config; ``python -m actors.profile`` is the same
without the grid flags), with this command's ``--batches`` / ``--tokens-per-row`` /
``--contexts`` / ``--repeats`` grid.
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
from actors.profile import (ENGINE_BATCHES, ENGINE_CONTEXTS, ENGINE_TOKENS_PER_ROW,
                            add_config_flags, profile_engine)
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
    add_config_flags(ap, "--engine: ")
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
