"""The engine profile of a vLLM-backed strategy (``actors.profile``, issue 43 item 1: "the
same for a vLLM backend"): whole engine steps at fixed batches in the vLLM venv, read back
by the capacity model (``analysis.model.profiled``) for that run's vLLM strategies only.

The unit test feeds known step costs through the phase plan and the point reduction; the
slow one profiles vLLM 0.32's CPU build for real on the committed target."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from actors import profile as prof_mod
from analysis.model import profiled
from configs import metric_names as mn

REPO = Path(__file__).resolve().parent.parent


class _Ids:
    """A tokenizer stand-in: one id per character (``_prompt_ids`` cuts exact lengths)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 500 + 1 for c in text]


def _cost(b: int, ctx: int) -> float:
    """The synthetic engine's decode step, ms: a floor, a per-row part and attention work."""
    return 3.0 + 0.5 * b + 0.004 * b * ctx


def _answer(phases: list[dict], drift: float = 0.0) -> list[dict]:
    """What ``python -m actors.engine.vllm_backend`` answers per phase for the synthetic
    engine: warm-up steps 10x slow (they must not count), a prefill step then decode steps
    at the phase's batch (one straggler step at a smaller batch that must not count); the
    machine slows by ``drift`` (a share) with every step phase."""
    out, n = [], 0
    for ph in phases:
        b = ph["batch_size"]
        if ph["kind"] == "prefill":
            p = ph["prefill_tokens"]
            out.append({"steps": [{"batch_size": 0, "prefill_tokens": p, "step_ms": 1.0 + 0.1 * p + i,
                                   "cpu_ms": 0.9 + 0.1 * p + i, "verification_tokens": 0,
                                   "context_tokens": 0, "verify_ms": 0.0}
                                  for i in range(len(ph["requests"]))]})
            continue
        ctx = ph.get("context_len", 64)
        slow = 10.0 if ph["kind"] == "warmup" else 1.0 + drift * n
        n += ph["kind"] == "steps"
        rows = [{"batch_size": 0, "prefill_tokens": b * ctx, "step_ms": 50.0, "cpu_ms": 50.0,
                 "verification_tokens": 0, "context_tokens": 0, "verify_ms": 50.0}]
        rows += [{"batch_size": b, "prefill_tokens": 0, "step_ms": slow * _cost(b, ctx),
                  "cpu_ms": slow * _cost(b, ctx) * 0.9, "verification_tokens": b,
                  "context_tokens": b * (ctx + j), "verify_ms": slow * _cost(b, ctx)}
                 for j in range(5)]
        if b > 1:
            rows.append({"batch_size": b - 1, "prefill_tokens": 0, "step_ms": 999.0,
                         "cpu_ms": 999.0, "verification_tokens": b, "context_tokens": b * ctx,
                         "verify_ms": 999.0})
        out.append({"steps": rows})
    return out


def _run(backend: str, name: str):
    return types.SimpleNamespace(runs=[types.SimpleNamespace(
        manifest={"memory": {name: {"backend": backend}}})])


def test_vllm_phase_steps_make_a_full_profile_the_vllm_run_takes_and_the_embedded_does_not():
    """Phases: a warm-up at every batch, then every context x batch, then the prefill
    lengths with ``repeats`` requests each. The points: per (B, ctx) the median of the
    decode-only steps at exactly B (warm-up and stragglers out) as a forward point at one
    token per row, a full grid that ``parts_from_profile`` interpolates (the forward at a
    grid point is its CPU ms; halfway between two batches, the mean); prefill the median.
    The entry applies to a run that served the strategy on vLLM, not to an embedded one."""
    batches, ctxs, prefill = (1, 2, 8), (64, 256), (16, 64)
    phases = prof_mod._vllm_phases(_Ids(), batches, ctxs, prefill, max_tokens=12, repeats=3)
    assert [ph["kind"] for ph in phases] == ["warmup"] * 3 + ["steps"] * 12 + ["prefill"] * 2
    grid = [(b, c) for c in ctxs for b in batches]
    assert [(ph["batch_size"], ph.get("context_len")) for ph in phases if ph["kind"] == "steps"] == (
        grid + grid[::-1])                          # the second pass reversed
    for ph in phases:
        assert len(ph["requests"]) == (3 if ph["kind"] == "prefill" else ph["batch_size"])
        n = ph.get("prefill_tokens") or ph.get("context_len") or min(ctxs)
        assert all(len(ids) == n and sp["ignore_eos"] for _, ids, sp in ph["requests"])
    fwd, pre, steps = prof_mod._vllm_points(phases, _answer(phases))
    assert {(p["batch_size"], p["tokens_per_row"], p["context_len"]) for p in fwd} == {
        (b, 1, c) for b in batches for c in ctxs}
    assert all(p["cpu_ms"] == pytest.approx(0.9 * _cost(p["batch_size"], p["context_len"]))
               for p in fwd)
    assert [(p["prefill_tokens"], p["step_ms"]) for p in pre] == [(16, pytest.approx(3.6)),
                                                                 (64, pytest.approx(8.4))]
    assert all(s["tokens_per_row"] == 1.0 and s["draft_ms"] == 0.0 and s["steps"] == 10
               for s in steps)
    # a machine slowing 5 % a phase: every point pays the same mean drift (1 + 0.05 x 5.5)
    drifted, _, _ = prof_mod._vllm_points(phases, _answer(phases, drift=0.05))
    assert all(p["cpu_ms"] == pytest.approx(0.9 * 1.275 * _cost(p["batch_size"], p["context_len"]))
               for p in drifted)
    name = "vllm-autoregressive"
    prof = {"kind": profiled.PROFILE_KIND, "strategies": {name: {
        "strategy": mn.AUTOREGRESSIVE, "backend": "vllm", "forward": fwd, "prefill": pre,
        "engine_steps": steps}}}
    parts = profiled.parts_from_profile(prof, name)
    assert parts is not None and parts.clock == "cpu_ms"
    assert float(parts.forward(8, 1, 256)) == pytest.approx(0.9 * _cost(8, 256))
    assert float(parts.forward(5, 1, 64)) == pytest.approx(0.9 * (_cost(2, 64) + _cost(8, 64)) / 2)
    assert float(parts.draft(4)) == 0.0
    assert profiled.profile_applies(prof, name, _run("vllm", name))
    assert not profiled.profile_applies(prof, name, _run("embedded", name))
    embedded = {"strategies": {name: {**prof["strategies"][name], "backend": None}}}
    assert not profiled.profile_applies(embedded, name, _run("vllm", name))
    assert not profiled.profile_applies(prof, "vllm-ngram", _run("vllm", "vllm-ngram"))


@pytest.mark.slow
def test_vllm_engine_profile_on_the_cpu_build(tmp_path):
    """``profile_engine`` on configs/serve-vllm.yaml's vllm-autoregressive, a small grid:
    one vLLM engine load in its venv, every (B, ctx) point with steps at exactly B and one
    verification token per row, the prefill points, and the entry marked vLLM; a strategy
    the config serves on neither engine is refused by name."""
    from tests.vllm_server import vllm_python

    vllm_python()      # skips, or fails under SPECLOAD_REQUIRE_VLLM=1, without the venv
    cfg = REPO / "configs" / "serve-vllm.yaml"
    prof = prof_mod.profile_engine(["vllm-autoregressive"], cfg, batches=(1, 4),
                                   step_contexts=(64,), prefill=(16, 64), max_tokens=12,
                                   repeats=2, log=lambda m: None)
    entry = prof["strategies"]["vllm-autoregressive"]
    assert entry["backend"] == "vllm" and entry["num_speculative_tokens"] == 0
    assert entry["engine"]["enable_prefix_caching"] is False
    assert {(p["batch_size"], p["tokens_per_row"], p["context_len"]) for p in entry["forward"]} == {
        (1, 1, 64), (4, 1, 64)}
    assert all(p["cpu_ms"] > 0 and p["step_ms"] > 0 for p in entry["forward"])
    assert [p["prefill_tokens"] for p in entry["prefill"]] == [16, 64]
    assert {s["batch_size"]: s["tokens_per_row"] for s in entry["engine_steps"]} == {1: 1.0, 4: 1.0}
    assert all(s["steps"] >= 16 for s in entry["engine_steps"])   # 2 passes x 11 decode steps
    assert prof["points"] == entry["forward"]
    assert profiled.parts_from_profile(prof, "vllm-autoregressive") is not None
    with pytest.raises(ValueError, match="nope"):
        prof_mod.profile_engine(["nope"], cfg, log=lambda m: None)
