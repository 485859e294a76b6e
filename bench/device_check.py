"""One prepared device check: ``python -m bench.device_check --out DIR [--device cuda|cpu] [--tiny]``.

Written for a short GPU loan (one command, under 8 minutes on an H200, no network,
PyTorch + transformers + safetensors + numpy/pandas/pyarrow and nothing else), and
run in CI on a CPU with ``--tiny`` (the same code path, smaller grid). Sections, each
with its own time budget; a section that runs out of time or memory is recorded as
skipped with its reason, and ``DIR/gpu_check.json`` is rewritten after every point so
a killed run leaves what it measured:

1. ``env``: device, GPU name and memory, torch / transformers versions, date.
2. ``engine``: the embedded engine (``actors.engine.llm_engine.LLMEngine``, the
   committed models under ``models/``) for every strategy in fp32 and bf16: greedy
   identity against autoregressive (the same prompts; a divergence where the
   autoregressive run's top-2 log-probabilities lie within ``TIE_LOGPROB`` is a tie,
   counted apart) and output tokens/s at several batch sizes. The engine's config and
   proposer options are pydantic models: this section imports pydantic lazily and is
   recorded as skipped (reason given) where pydantic is not importable; every other
   section, and this module's own import chain, needs no pydantic, Ray or vLLM.
3. ``curves``: step-cost curves of real shapes with random weights
   (``bench.step_cost``: ``qwen3-0.6b``, ``qwen3-8b``, ``llama-3-8b``; ``tiny`` with
   ``--tiny``) over batch x tokens per row x context; one curve file per shape in the
   ``bench.step_cost`` format (``DIR/curves/<shape>-<device>.json``, read by
   ``python -m analysis plan --cost-curve``), a batch whose KV cache would not fit is
   skipped with its size. The summary gives the verify cost of k+1 tokens per row as
   a multiple of a 1-token step, per batch size (``verify_multiple``).
4. ``DIR/verify_multiple.png``: that multiple against batch size (written with
   numpy + zlib; no matplotlib on the device).

Exit code 0 when the command ran (skipped sections included), 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import struct
import sys
import time
import zlib
from pathlib import Path

import torch

from bench import step_cost as cc

STRATEGIES = ("autoregressive", "draft_model", "ngram", "dflash", "dflash2", "dspark")
TIE_LOGPROB = {"float32": 1e-3, "bfloat16": 0.1}  # top-2 gap (nats) under which a divergence is a tie

# (full, tiny) settings per section
GRID = {
    # qwen3-8b first: its verify-of-5 multiple at batch 1..256 is the figure the planner needs
    "cuda": {"shapes": ("qwen3-8b", "llama-3-8b", "qwen3-0.6b"),
             "batches": (1, 2, 4, 8, 16, 32, 64, 128, 256), "tokens_per_row": (1, 2, 4, 5, 8, 16),
             "contexts": (512, 4096), "repeats": 3},
    "cpu": {"shapes": ("qwen3-0.6b",), "batches": (1, 2, 4), "tokens_per_row": (1, 2, 4, 5, 8),
            "contexts": (512,), "repeats": 2},
    "tiny": {"shapes": ("tiny",), "batches": (1, 2, 4), "tokens_per_row": (1, 2, 5),
             "contexts": (64,), "repeats": 2},
}
ENGINE = {"full": {"prompts": 8, "max_tokens": 32, "batches": (1, 8, 32), "tps_requests": 32,
                   "dtypes": ("float32", "bfloat16")},
          "tiny": {"prompts": 2, "max_tokens": 8, "batches": (1, 2), "tps_requests": 2,
                   "dtypes": ("float32", "bfloat16")}}
BUDGET_S = {"engine": 200.0, "curves": 230.0}    # of the 8 minutes; the rest is start-up
PROMPTS = ("def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main():\n    ",
           "class Stack:\n    def __init__(self):\n        ", "The quick brown fox",
           "for i in range(10):\n    print(", "# Return the sum of a list\ndef total(xs):\n    ",
           "with open('data.txt') as f:\n    ", "def is_prime(n):\n    if n < 2:\n        ")


class Report:
    """The JSON written under DIR, rewritten on every ``save``."""

    def __init__(self, out: Path):
        self.out = out
        self.data: dict = {"status": "running", "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        from configs.jsonio import write_json
        write_json(self.out / "gpu_check.json", self.data)


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def env_section(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu_name=p.name, gpu_memory_gib=p.total_memory / 2**30,
                    cuda=torch.version.cuda)
    return info


# ---------------------------------------------------------------- engine


def _engine_run(strategy: str, device: str, dtype: str, prompts, max_tokens: int, batch: int,
                logprobs: int | None):
    """Token ids per prompt and the wall seconds of a greedy run of ``strategy``."""
    from actors.engine.config import EngineConfig
    from actors.engine.llm_engine import LLMEngine, run_requests
    from actors.engine.types import SamplingParams

    from actors.engine.config import DEFAULT_DRAFT

    eng = LLMEngine(EngineConfig(strategy=strategy, device=device, dtype=dtype,
                                 max_num_seqs=max(batch, 1),
                                 draft_model=str(DEFAULT_DRAFT) if strategy == "draft_model" else None))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs,
                            ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = run_requests(eng, reqs, batch_size=batch)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    del eng
    return [out[f"r{i}"] for i in range(len(prompts))], wall


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _identity(ref: list[dict], got: list[dict], dtype: str) -> dict:
    """{"identical", "ties", "mismatches", "total", "diverged"} of ``got`` against the
    autoregressive ``ref`` (same prompts): a first difference whose top-2 logprob gap in
    ``ref`` is within ``TIE_LOGPROB[dtype]`` is a tie, not a violation."""
    same = ties = 0
    diverged = []
    for i, (r, g) in enumerate(zip(ref, got)):
        d = _first_diff(r["token_ids"], g["token_ids"])
        if d is None:
            same += 1
            continue
        top = r["logprobs"][d].top if d < len(r["logprobs"]) else []
        gap = (top[0][3] - top[1][3]) if len(top) >= 2 else None
        tie = gap is not None and gap <= TIE_LOGPROB[dtype]
        ties += tie
        diverged.append({"prompt": i, "position": d, "top2_gap": gap, "tie": tie})
    return {"identical": same, "ties": ties, "mismatches": len(ref) - same - ties,
            "total": len(ref), "diverged": diverged}


def _identity_dtype(sec: dict, dtype: str, device: str, prompts: list[str], max_tokens: int,
                    report: Report, deadline: float) -> None:
    """Greedy identity of every strategy against ``autoregressive`` in ``dtype``, into
    ``sec["identity"]`` (what failed or ran out of time into ``sec["skipped"]``)."""
    try:
        ref, _ = _engine_run("autoregressive", device, dtype, prompts, max_tokens,
                             len(prompts), logprobs=2)
    except Exception as exc:  # noqa: BLE001 - record, go on
        sec["skipped"].append({"dtype": dtype, "reason": f"autoregressive: {exc!r}"[:400]})
        return
    for strategy in STRATEGIES:
        if time.monotonic() > deadline:
            sec["skipped"].append({"dtype": dtype, "strategy": strategy,
                                   "reason": "engine section's time budget spent"})
            continue
        try:
            got, _ = _engine_run(strategy, device, dtype, prompts, max_tokens,
                                 len(prompts), logprobs=None)
        except Exception as exc:  # noqa: BLE001
            sec["skipped"].append({"dtype": dtype, "strategy": strategy,
                                   "reason": f"{'OOM' if _oom(exc) else 'error'}: {exc!r}"[:400]})
            report.save()
            continue
        sec["identity"][f"{strategy}/{dtype}"] = _identity(ref, got, dtype)
        report.save()


def _throughput(sec: dict, s: dict, device: str, report: Report, deadline: float) -> None:
    """Tokens/s per strategy at each batch size of ``s`` (the device's default dtype), into
    ``sec["tokens_per_s"]``."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    for strategy in STRATEGIES:
        for b in s["batches"]:
            if time.monotonic() > deadline:
                sec["skipped"].append({"strategy": strategy, "batch": b,
                                       "reason": "engine section's time budget spent"})
                continue
            n = max(b, s["tps_requests"])
            ps = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
            try:
                outs, wall = _engine_run(strategy, device, dtype, ps, s["max_tokens"], b, None)
            except Exception as exc:  # noqa: BLE001
                sec["skipped"].append({"strategy": strategy, "batch": b,
                                       "reason": f"{'OOM' if _oom(exc) else 'error'}: {exc!r}"[:400]})
                continue
            toks = sum(len(o["token_ids"]) for o in outs)
            sec["tokens_per_s"].setdefault(strategy, {})[str(b)] = {
                "dtype": dtype, "requests": n, "output_tokens": toks, "wall_s": wall,
                "tokens_per_s": toks / wall}
            report.save()


def engine_section(device: str, tiny: bool, report: Report, deadline: float) -> dict:
    """Greedy identity vs autoregressive and tokens/s per strategy x dtype (module doc)."""
    try:
        import pydantic  # noqa: F401  (the engine's config is a pydantic model)
    except ImportError:
        return {"skipped": "pydantic is not importable here: the embedded engine's EngineConfig "
                           "and proposer options are pydantic models (carry its wheel to run "
                           "this section)"}
    s = ENGINE["tiny" if tiny else "full"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(s["prompts"])]
    sec: dict = {"prompts": len(prompts), "max_tokens": s["max_tokens"], "identity": {},
                 "tokens_per_s": {}, "skipped": []}
    report.data["sections"]["engine"] = sec
    for dtype in s["dtypes"]:
        if dtype == "bfloat16" and device == "cpu" and not tiny:
            sec["skipped"].append({"dtype": dtype, "reason": "bf16 on CPU: not the GPU's path"})
            continue
        _identity_dtype(sec, dtype, device, prompts, s["max_tokens"], report, deadline)
    _throughput(sec, s, device, report, deadline)
    return sec


# ---------------------------------------------------------------- curves


def _kv_bytes(cfg: dict, slots: int, max_len: int, elem: int) -> int:
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * slots * max_len * elem


def _curve_header(shape: str, device: str, dtype, cfg: dict, model, grid: dict) -> dict:
    """The curve file's fields before any point (``bench.step_cost``'s format)."""
    return {"shape": shape, "device": device, "dtype": str(dtype).replace("torch.", ""),
            "config": cfg, "num_params": model.num_params(), "torch": torch.__version__,
            "threads": torch.get_num_threads() if device == "cpu" else None,
            "repeats": grid["repeats"], "random_weights": True,
            "gpu_name": torch.cuda.get_device_name() if device == "cuda" else None,
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "measured_by": "python -m bench.device_check", "points": []}


def _batches_that_fit(cfg: dict, grid: dict, ctx: int, max_len: int, elem: int, device: str,
                      rec: dict) -> list[int]:
    """The grid's batch sizes whose KV cache at ``max_len`` takes at most 60% of the free
    memory (8 GiB assumed on a CPU); the others go to ``rec["skipped"]``."""
    free = (torch.cuda.mem_get_info()[0] if device == "cuda" else 8 * 2**30)
    fits = [b for b in grid["batches"] if _kv_bytes(cfg, b, max_len, elem) <= 0.6 * free]
    for b in grid["batches"]:
        if b not in fits:
            rec["skipped"].append({"context_len": ctx, "batch_size": b, "reason": (
                f"KV cache {_kv_bytes(cfg, b, max_len, elem) / 2**30:.1f} GiB > 60% of "
                f"{free / 2**30:.1f} GiB free")})
    return fits


def _time_point(runner, b: int, q: int, ctx: int, grid: dict, device: str, rec: dict) -> dict | None:
    """One grid point's curve row (median step ms, p90, thread CPU ms on a CPU), or None
    with the reason in ``rec["skipped"]``."""
    try:
        ms, cpu = cc.time_step(runner, b, q, ctx, grid["repeats"], device)
    except Exception as exc:  # noqa: BLE001
        rec["skipped"].append({"context_len": ctx, "batch_size": b, "tokens_per_row": q,
                               "reason": f"{'OOM' if _oom(exc) else 'error'}: {exc!r}"[:300]})
        if device == "cuda":
            torch.cuda.empty_cache()
        return None
    srt = sorted(ms)
    return {"batch_size": b, "tokens_per_row": q, "context_len": ctx,
            "step_ms": statistics.median(ms),
            "step_ms_p90": srt[min(len(srt) - 1, int(0.9 * len(srt)))],
            "cpu_ms": statistics.median(cpu) if device == "cpu" else None,
            "batch_tokens": b * q}


def _curve_context(model, cfg: dict, ctx: int, grid: dict, device: str, elem: int, curve: dict,
                   path: Path, rec: dict, report: Report, deadline: float) -> None:
    """Every batch x tokens-per-row point at context ``ctx`` into ``curve["points"]``, the
    curve file rewritten after each point."""
    from configs.jsonio import write_json

    max_len = ctx + max(grid["tokens_per_row"])
    fits = _batches_that_fit(cfg, grid, ctx, max_len, elem, device, rec)
    if not fits:
        return
    try:
        runner = cc.ModelRunner(model, num_slots=max(fits), max_len=max_len)
    except Exception as exc:  # noqa: BLE001
        rec["skipped"].append({"context_len": ctx, "reason": f"KV cache: {exc!r}"[:400]})
        return
    for b in fits:
        for q in grid["tokens_per_row"]:
            if time.monotonic() > deadline:
                rec["skipped"].append({"context_len": ctx, "batch_size": b, "tokens_per_row": q,
                                       "reason": "curves section's time budget spent"})
                continue
            point = _time_point(runner, b, q, ctx, grid, device, rec)
            if point is None:
                continue
            curve["points"].append(point)
            rec["points"] = len(curve["points"])
            write_json(path, curve)
            report.save()
    del runner
    if device == "cuda":
        torch.cuda.empty_cache()


def curve_shape(shape: str, device: str, grid: dict, out_dir: Path, report: Report,
                deadline: float) -> dict:
    """Time one shape's grid (``bench.step_cost.time_step``), writing its curve file after
    every point; returns {"file", "points", "skipped"}."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = cc.shape_config(shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{shape}-{device}.json"
    rec = {"file": str(path), "points": 0, "skipped": []}
    t0 = time.perf_counter()
    try:
        model = cc.fuse(cc.random_model(cfg, device, dtype))
    except Exception as exc:  # noqa: BLE001
        rec["skipped"].append({"reason": f"{'OOM' if _oom(exc) else 'error'} building: {exc!r}"[:400]})
        return rec
    rec["build_s"] = time.perf_counter() - t0
    curve = _curve_header(shape, device, dtype, cfg, model, grid)
    elem = torch.finfo(dtype).bits // 8
    for ctx in grid["contexts"]:
        _curve_context(model, cfg, ctx, grid, device, elem, curve, path, rec, report, deadline)
    if device == "cuda":
        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    rec["verify_multiple"] = verify_multiple(curve["points"], device)
    return rec


def verify_multiple(points: list[dict], device: str) -> dict:
    """{context: {batch: {q: step(B, q) / step(B, 1)}}}: the verify cost of q tokens per row
    as a multiple of a 1-token step at the same batch (thread CPU ms on a CPU, else wall)."""
    col = "cpu_ms" if device == "cpu" else "step_ms"
    by = {(p["context_len"], p["batch_size"], p["tokens_per_row"]): p[col] for p in points}
    out: dict = {}
    for (ctx, b, q), v in sorted(by.items()):
        one = by.get((ctx, b, 1))
        if one:
            out.setdefault(str(ctx), {}).setdefault(str(b), {})[str(q)] = v / one
    return out


def curves_section(device: str, tiny: bool, out: Path, report: Report, deadline: float) -> dict:
    grid = GRID["tiny" if tiny else device]
    sec: dict = {"grid": {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()},
                 "shapes": {}}
    report.data["sections"]["curves"] = sec
    shapes = grid["shapes"]
    for i, shape in enumerate(shapes):
        # an even share of what is left for each shape still to run
        share = (deadline - time.monotonic()) / (len(shapes) - i)
        sec["shapes"][shape] = curve_shape(shape, device, grid, out / "curves", report,
                                           min(deadline, time.monotonic() + share))
        report.save()
    return sec


# ---------------------------------------------------------------- PNG (numpy + zlib)


def write_png(path: Path, img) -> None:
    """An RGB uint8 array [H, W, 3] as a PNG file."""
    import numpy as np

    img = np.ascontiguousarray(img, dtype=np.uint8)
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def plot_verify_multiple(sec: dict, path: Path) -> int:
    """verify_multiple (y, linear from 0) against log2 batch (x), one coloured line per
    shape x tokens per row at the first context; returns the number of lines drawn."""
    import numpy as np

    W, H, m = 640, 400, 40
    img = np.full((H, W, 3), 255, np.uint8)
    img[H - m, m:W - m] = 0
    img[m:H - m, m] = 0
    lines = []
    for shape, rec in sec.get("shapes", {}).items():
        vm = rec.get("verify_multiple") or {}
        if not vm:
            continue
        by_b = vm[sorted(vm, key=int)[0]]
        qs = sorted({int(q) for row in by_b.values() for q in row} - {1})
        for q in qs:
            pts = [(int(b), row[str(q)]) for b, row in by_b.items() if str(q) in row]
            if len(pts) >= 1:
                lines.append(sorted(pts))
    if not lines:
        return 0
    xs = np.log2([b for ln in lines for b, _ in ln])
    ymax = max(y for ln in lines for _, y in ln) * 1.1
    x0, x1 = xs.min(), max(xs.max(), xs.min() + 1)
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
              (140, 86, 75), (227, 119, 194), (127, 127, 127)]

    def px(b, y):
        return (int(m + (np.log2(b) - x0) / (x1 - x0) * (W - 2 * m - 1)),
                int(H - m - y / ymax * (H - 2 * m - 1)))

    for i, ln in enumerate(lines):
        c = colors[i % len(colors)]
        pp = [px(b, y) for b, y in ln]
        for (xa, ya), (xb, yb) in zip(pp, pp[1:] or pp):
            n = max(abs(xb - xa), abs(yb - ya), 1)
            for t in np.linspace(0, 1, n + 1):
                x, y = int(round(xa + t * (xb - xa))), int(round(ya + t * (yb - ya)))
                img[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = c
        for x, y in pp:
            img[max(y - 3, 0):y + 4, max(x - 3, 0):x + 4] = c
    # y = 1 reference (a verify as cheap as a 1-token step)
    _, y1 = px(2 ** x0, 1.0)
    img[y1, m:W - m:4] = (160, 160, 160)
    write_png(path, img)
    return len(lines)


def summary(sections: dict) -> dict:
    """The headline figures: identity "identical/ties/mismatches of total" per strategy/dtype,
    tokens/s per strategy and batch, verify-of-5 (q = 5 tokens per row, k = 4) multiple of a
    1-token step per shape, context and batch."""
    eng, cur = sections.get("engine") or {}, sections.get("curves") or {}
    return {
        "identity": {k: f"{v['identical']}/{v['ties']}/{v['mismatches']} of {v['total']}"
                     for k, v in (eng.get("identity") or {}).items()},
        "tokens_per_s": {s_: {b: round(r["tokens_per_s"], 1) for b, r in by.items()}
                         for s_, by in (eng.get("tokens_per_s") or {}).items()},
        "verify5_multiple": {shape: {ctx: {b: row.get("5") for b, row in by_b.items()}
                                     for ctx, by_b in (rec.get("verify_multiple") or {}).items()}
                             for shape, rec in (cur.get("shapes") or {}).items()},
    }


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.device_check",
                                 description="The prepared device check: the embedded engine per "
                                             "strategy and dtype, and step-cost curves of real "
                                             "shapes (random weights); JSON + PNG under --out.")
    ap.add_argument("--out", type=Path, required=True, help="directory for the JSON and PNG files")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when torch sees one, else cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="CI shape: a 2-layer random model and a 2-prompt engine check")
    ap.add_argument("--sections", default="engine,curves",
                    help="comma-separated subset of engine,curves (default both)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for engine + curves (default 430: under 8 minutes with start-up)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device on this machine")
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = sorted(set(sections) - {"engine", "curves"})
    if bad:
        ap.error(f"--sections: unknown {bad}; expected engine, curves")
    if a.budget_s is not None and a.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {a.budget_s}")
    total = a.budget_s or sum(BUDGET_S.values())
    share = {k: v / sum(BUDGET_S.values()) * total for k, v in BUDGET_S.items()}
    if device == "cpu":
        torch.set_num_threads(1)   # the curves' CPU clock is per thread (bench.step_cost)
    t0 = time.monotonic()
    report = Report(a.out)
    report.data.update(command=" ".join(["python -m bench.device_check"] + (argv or sys.argv[1:])),
                       tiny=a.tiny, env=env_section(device), budget_s=share)
    report.save()
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for name in sections:
        start = time.monotonic()
        log(f"device_check: {name} (budget {share[name]:.0f} s)")
        try:
            if name == "engine":
                res = engine_section(device, a.tiny, report, start + share[name])
            else:
                res = curves_section(device, a.tiny, a.out, report, start + share[name])
        except Exception as exc:  # noqa: BLE001 - a section's failure is a result
            res = {"skipped": f"{'OOM' if _oom(exc) else 'error'}: {exc!r}"[:600]}
        res["wall_s"] = time.monotonic() - start
        report.data["sections"][name] = res
        report.save()
    if "curves" in report.data["sections"]:
        n = plot_verify_multiple(report.data["sections"]["curves"], a.out / "verify_multiple.png")
        report.data["png"] = str(a.out / "verify_multiple.png") if n else None
    report.data["summary"] = summary(report.data["sections"])
    report.data["status"] = "done"
    report.data["wall_s"] = time.monotonic() - t0
    report.save()
    print(json.dumps({"out": str(a.out / "gpu_check.json"), "wall_s": round(report.data["wall_s"], 1),
                      "sections": {k: ("skipped" if isinstance(v, dict) and isinstance(v.get("skipped"), str)
                                       else "ran") for k, v in report.data["sections"].items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
