"""``engine.backend: vllm``: vLLM's engine behind specload's Serve deployments.

Fast (no vLLM needed): the config validation (errors name the key), the strategy ->
EngineArgs / speculative_config mapping, the SamplingParams mapping, the step-row
columns, the per-request stats from vLLM's histogram, the clean environment of the
vLLM engine process, configs/serve-vllm.yaml.

Slow (``@pytest.mark.slow``; the vLLM venv, tests/vllm_server.py's ``vllm_python``:
skipped without it unless SPECLOAD_REQUIRE_VLLM=1): the adapter in the vLLM venv (no
Ray) against the embedded engine on held-out prompts, greedy fp32, k = 4 (outputs
identical, tie-aware; tau of each; step rows consistent with the outputs); and Serve
end to end with a vLLM-backed strategy (both routes, a 400, /health, the step log,
a short ``python -m loadgen`` run whose steps.parquet has the vLLM strategy's rows).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.engine.config import EngineConfig
from actors.engine.types import SamplingParams
from actors.engine.vllm_backend import (REPO_ROOT, spec_stats_from_vllm, step_row,
                                        vllm_engine_args, vllm_env, vllm_sampling_kwargs)
from configs import metric_names as M
from configs.serve_config import REPLICA_ENV

REPO = Path(__file__).resolve().parent.parent
TARGET = str(REPO / "models" / "target")
DRAFT = str(REPO / "models" / "draft")
K = 4
N_PROMPTS = 8
MAX_TOKENS = 32


# ------------------------------------------------------------------ fast unit tests
@pytest.mark.parametrize("kw, key", [
    ({"backend": "vllm", "strategy": "ngram", "engine_kwargs": {"max_num_seqs": 2}},
     "engine_kwargs.max_num_seqs"),
    ({"backend": "embedded", "engine_kwargs": {"enforce_eager": True}}, "engine_kwargs"),
    ({"backend": "embedded", "speculative_config": {"method": "ngram"}}, "speculative_config"),
    ({"backend": "vllm", "strategy": "dflash"}, "draft_model"),
    ({"backend": "vllm", "strategy": "dspark", "draft_model": str(REPO / "models" / "dspark")},
     "train.export_vllm"),                       # specload's own layout: vLLM cannot load it
    ({"backend": "vllm", "strategy": "eagle3"}, "speculative_config"),
    ({"backend": "vllm", "strategy": "draft_model"}, "draft_model"),
    ({"backend": "vllm", "strategy": "ngram", "strategy_options": {"prompt_lookup_mx": 3}},
     "prompt_lookup_mx"),
    ({"backend": "vllm", "strategy": "ngram", "num_speculative_tokens": 3,
      "num_speculative_tokens_per_batch_size": {"1-8": 4}}, "num_speculative_tokens_per_batch_size"),
    ({"backend": "vllm", "strategy": "ngram",
      "num_speculative_tokens_per_batch_size": {"2-8": 2}}, "num_speculative_tokens_per_batch_size"),
    ({"backend": "vllm", "strategy": "ngram", "enable_adaptive_verification": True},
     "enable_adaptive_verification"),
    ({"backend": "embedded", "strategy": "dspark", "enable_adaptive_verification": True},
     "enable_adaptive_verification"),
    ({"backend": "vllm", "strategy": "ngram", "draft_deadline_ms": 5}, "draft_deadline_ms"),
    ({"backend": "vllm", "strategy": "autoregressive", "num_speculative_tokens": 3},
     "num_speculative_tokens"),
    ({"backend": "vlm"}, "backend"),
    ({"backend": "vllm", "engine_kwarg": {}}, "engine_kwarg"),
])
def test_engine_config_errors_name_the_key(kw, key):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert key in str(e.value)


def test_the_embedded_engine_refuses_backend_vllm():
    from actors.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="backend 'vllm'"):
        LLMEngine(EngineConfig(backend="vllm", strategy="ngram"))


def test_strategy_settings_map_to_vllm():
    ng = vllm_engine_args(EngineConfig(backend="vllm", strategy="ngram", num_speculative_tokens=3,
                                       strategy_options={"prompt_lookup_min": 1,
                                                         "prompt_lookup_max": 5},
                                       engine_kwargs={"enforce_eager": True}).model_dump())
    assert ng["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    assert ng["enforce_eager"] is True and ng["dtype"] == "float32"
    assert ng["enable_logging_iteration_details"] and not ng["disable_log_stats"]
    dm = vllm_engine_args(EngineConfig(backend="vllm", strategy="draft_model", draft_model=DRAFT,
                                       served_model_name="vllm-draft_model").model_dump())
    assert dm["speculative_config"] == {"method": "draft_model", "model": DRAFT,
                                        "num_speculative_tokens": 4}
    assert dm["served_model_name"] == "vllm-draft_model"
    ar = vllm_engine_args(EngineConfig(backend="vllm", num_speculative_tokens=0,
                                       max_model_len=512).model_dump(), cuda=True)
    assert ar["speculative_config"] is None and ar["max_model_len"] == 512
    assert ar["dtype"] == "bfloat16"          # auto on CUDA, as the embedded engine
    # prefix caching is the engine field on both backends (vLLM's own default, on, is not used)
    assert ar["enable_prefix_caching"] is False and ng["enable_prefix_caching"] is False
    pc = EngineConfig(backend="vllm", enable_prefix_caching=True).model_dump()
    assert vllm_engine_args(pc)["enable_prefix_caching"] is True
    with pytest.raises(ValueError, match="engine_kwargs.enable_prefix_caching"):
        vllm_engine_args({**pc, "engine_kwargs": {"enable_prefix_caching": False}})
    # a method specload does not host passes through (strategy is its label)
    eagle = EngineConfig(backend="vllm", strategy="eagle3", num_speculative_tokens=3,
                         speculative_config={"method": "eagle3", "model": "/m/head"})
    assert vllm_engine_args(eagle.model_dump())["speculative_config"] == {
        "method": "eagle3", "model": "/m/head", "num_speculative_tokens": 3}


def test_block_drafters_and_load_adaptive_k_map_to_vllm(tmp_path):
    """dflash / dflash2 / dspark map to vLLM's methods (dflash2 is vLLM's method dflash:
    the checkpoint's architecture picks DFlash 2); vLLM's own field names pass through."""
    drafter = tmp_path / "dflash-vllm"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    for strategy, method in (("dflash", "dflash"), ("dflash2", "dflash"), ("dspark", "dspark")):
        args = vllm_engine_args(EngineConfig(backend="vllm", strategy=strategy,
                                             draft_model=str(drafter)).model_dump())
        assert args["speculative_config"] == {"method": method, "model": str(drafter),
                                              "num_speculative_tokens": 7}
    sched = EngineConfig(backend="vllm", strategy="dflash", draft_model=str(drafter),
                         num_speculative_tokens=5,
                         num_speculative_tokens_per_batch_size={"1-4": 5, "5-16": 2, "17": 0})
    spec = vllm_engine_args(sched.model_dump())["speculative_config"]
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 5], [5, 16, 2], [17, 17, 0]]
    adaptive = EngineConfig(backend="vllm", strategy="dspark", draft_model=str(drafter),
                            enable_adaptive_verification=True)
    assert vllm_engine_args(adaptive.model_dump())["speculative_config"][
        "enable_adaptive_verification"] is True
    # vLLM's list form is accepted as well, and ngram takes a schedule too
    ng = EngineConfig(backend="vllm", strategy="ngram",
                      num_speculative_tokens_per_batch_size=[[1, 8, 4], [9, 64, 1]])
    assert vllm_engine_args(ng.model_dump())["speculative_config"][
        "num_speculative_tokens_per_batch_size"] == [[1, 8, 4], [9, 64, 1]]


def test_sampling_params_map_to_vllm():
    sp = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=-1, seed=3,
                        stop=["\n\n"], ignore_eos=True, min_tokens=2, logprobs=1,
                        skip_special_tokens=False)
    kw = vllm_sampling_kwargs(sp, 8)
    assert kw == {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 3,
                  "stop": ["\n\n"], "ignore_eos": True, "min_tokens": 2, "logprobs": 1,
                  "skip_special_tokens": False, "spaces_between_special_tokens": True,
                  "stop_token_ids": None, "include_stop_str_in_output": False}
    assert vllm_sampling_kwargs(SamplingParams(temperature=1e-7), 4)["temperature"] == 0.0
    stop = vllm_sampling_kwargs(SamplingParams(stop_token_ids=[5, 9],
                                               include_stop_str_in_output=True), 4)
    assert stop["stop_token_ids"] == [5, 9] and stop["include_stop_str_in_output"] is True


def test_step_row_has_the_embedded_columns():
    class Details:
        num_ctx_tokens, num_generation_tokens, elapsed_ms = 12, 10, 22.0

    class Spec:
        num_drafts, num_draft_tokens, num_accepted_tokens = 2, 8, 5

    row = step_row(strategy="ngram", model="vllm-ngram", replica="r", step_ms=3.0, cpu_ms=2.0,
                   details=Details, spec=Spec, num_waiting=1, emitted=7, prefill_emitted=1,
                   batch_size=2, k=4, context_before=100)
    assert tuple(row) == M.STEP_LOG_COLUMNS
    assert (row[M.STEP_PREFILL_TOKENS], row[M.STEP_VERIFICATION_TOKENS], row[M.STEP_DRAFT_TOKENS],
            row[M.STEP_ACCEPTED_TOKENS], row[M.STEP_BATCH_SIZE]) == (12, 10, 8, 5, 2)
    # the step's time, the generation tokens' share of it; ragged batch; KV attended
    assert row[M.STEP_VERIFY_MS] == pytest.approx(3.0 * 10 / 22) and row[M.STEP_DRAFT_MS] == 0
    assert row[M.STEP_PADDED_TOKENS] == 10 and row[M.STEP_CONTEXT_TOKENS] == 108
    # a stop cut: accepted never above what the decodes delivered beyond one token each
    cut = step_row(strategy="ngram", model="m", replica="r", step_ms=1, cpu_ms=1, details=Details,
                   spec=Spec, num_waiting=0, emitted=4, prefill_emitted=0, batch_size=2, k=4)
    assert cut[M.STEP_ACCEPTED_TOKENS] == 2


def test_step_row_k_is_what_vllm_drafted():
    """num_speculative_tokens of a vLLM step is its draft tokens per drafting request: with
    ``num_speculative_tokens_per_batch_size`` ({"1-10": 4, "11-32": 2}) the configured 4 is
    only the largest k, and a batch of 15 drafts 2 each (a measured validation run's steps
    said 4 at every batch before)."""
    class Details:
        num_ctx_tokens, num_generation_tokens, elapsed_ms = 0, 45, 10.0

    def row(n_drafts, n_tokens, dynamic):
        class Spec:
            num_drafts, num_draft_tokens, num_accepted_tokens = n_drafts, n_tokens, 0
        return step_row(strategy="ngram", model="m", replica="r", step_ms=1, cpu_ms=1,
                        details=Details, spec=Spec, num_waiting=0, emitted=15,
                        prefill_emitted=0, batch_size=15, k=4, dynamic_k=dynamic)[
            M.STEP_NUM_SPEC_TOKENS]

    assert row(15, 30, True) == 2 and row(3, 12, True) == 4
    assert row(14, 27, True) == 2            # one draft cut short near the context's end
    assert row(0, 0, True) is None           # nobody drafted: k not observed
    assert row(0, 0, False) == 4             # a fixed k: the configured one


def test_request_stats_from_vllm_histogram():
    class Metrics:
        histogram = [3, 1, 0, 2, 0]     # 6 verify steps with drafts: accepted 0,0,0,1,3,3
        num_draft_tokens = 20

    s = spec_stats_from_vllm(Metrics, num_steps=9)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (6, 20, 7)
    assert s.num_accepted_tokens_per_pos == [3, 2, 2, 0]
    assert s.acceptance_length == pytest.approx(1 + 7 / 6) and s.num_steps == 9
    assert spec_stats_from_vllm(None, 3).num_drafts == 0


def test_memory_figures_from_the_checkpoints():
    """vLLM's CPU backend repacks linear weights outside the modules' parameters: the
    report takes weights from the checkpoints and KV per token from the configs (the
    embedded engine's memory tests check the same figures from its tensors)."""
    from actors.engine.vllm_backend import checkpoint_bytes, kv_bytes_per_token

    cfg = json.loads((REPO / "models" / "target" / "config.json").read_text())
    assert kv_bytes_per_token(TARGET, 4) == 2 * cfg["num_hidden_layers"] * cfg[
        "num_key_value_heads"] * cfg["head_dim"] * 4
    tb = checkpoint_bytes(TARGET, 4)
    assert tb > cfg["vocab_size"] * cfg["hidden_size"] * 4     # more than the embedding
    assert checkpoint_bytes(TARGET, 2) * 2 == tb
    assert checkpoint_bytes(str(REPO / "missing"), 4) == 0 and kv_bytes_per_token(None, 4) == 0


def test_vllm_process_env_is_clean(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site-packages")
    monkeypatch.setenv("VIRTUAL_ENV", "/main/.venv")
    env = vllm_env()
    assert env["PYTHONPATH"] == str(REPO_ROOT) and "VIRTUAL_ENV" not in env
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_engine_process_with_a_missing_python_is_engine_dead():
    from actors.engine.errors import EngineDead
    from actors.serve.engine_core import EngineProcess

    with pytest.raises(EngineDead, match="not an executable"):
        EngineProcess("actors.engine.vllm_backend:make_vllm_engine", {}, python="/nonexistent/python")


def test_serve_vllm_yaml_validates_and_a_missing_venv_skips(tmp_path):
    import yaml

    from actors.serve.app import missing_reason, resolve_engine_config
    from configs.serve_config import ServeAppConfig, configured_strategy_names

    path = REPO / "configs" / "serve-vllm.yaml"
    names = configured_strategy_names(str(path))
    assert {"autoregressive", "vllm-autoregressive", "ngram", "vllm-ngram", "draft_model",
            "vllm-draft_model", "dflash", "vllm-dflash"} <= set(names)
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    cfg = ServeAppConfig.model_validate(args)
    for e in cfg.strategies:
        EngineConfig(**resolve_engine_config(e.engine))
    e = next(x for x in cfg.strategies if x.name == "vllm-ngram")
    e.engine["vllm_python"] = str(tmp_path / "no-python")
    assert "backend vllm" in missing_reason(e)


def test_k_variants_of_serve_vllm_yaml():
    """``python -m loadgen --k`` on configs/serve-vllm.yaml: vLLM strategies get k variants
    like the embedded ones; the baseline stays; vllm-autoregressive only when asked."""
    import yaml

    from configs.serve_config import variant_config

    cfg = yaml.safe_load((REPO / "configs" / "serve-vllm.yaml").read_text())
    _, variants = variant_config(cfg, ["vllm-ngram", "ngram"], [2, 4], None)
    assert set(variants) == {"autoregressive", "ngram-k2", "ngram-k4", "vllm-ngram-k2",
                             "vllm-ngram-k4"}
    assert variants["vllm-ngram-k2"]["engine"]["backend"] == "vllm"
    assert variants["vllm-ngram-k2"]["engine"]["num_speculative_tokens"] == 2
    _, both = variant_config(cfg, ["vllm-autoregressive", "vllm-ngram"], [3], None)
    assert set(both) == {"autoregressive", "vllm-autoregressive", "vllm-ngram-k3"}


def test_bad_engine_kwargs_fail_at_deploy_naming_the_key():
    from actors.engine.vllm_backend import check_engine_kwargs

    python = _vllm_python_or_skip()
    with pytest.raises(ValueError, match=r"engine_kwargs\.enforce_eagr.*enforce_eager"):
        check_engine_kwargs({"enforce_eagr": True}, python)
    check_engine_kwargs({"enforce_eager": True, "block_size": 16}, python)


def _vllm_python_or_skip() -> str:
    from tests.vllm_server import vllm_python

    return vllm_python()


# ---------------------------------------------------- slow: the adapter vs embedded
def _configs() -> dict[str, dict]:
    common = {"model": TARGET, "max_num_seqs": 8, "max_model_len": 1024, "dtype": "float32",
              "device": "cpu"}
    return {"autoregressive": {**common, "strategy": "autoregressive", "num_speculative_tokens": 0},
            "ngram": {**common, "strategy": "ngram", "num_speculative_tokens": K,
                      "strategy_options": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}},
            "draft_model": {**common, "strategy": "draft_model", "draft_model": DRAFT,
                            "num_speculative_tokens": K}}


def _requests(prompts: list[dict], logprobs: int | None = None) -> list:
    return [(p["id"], p["prompt"], {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                    **({"logprobs": logprobs} if logprobs is not None else {})})
            for p in prompts]


def run_vllm(python: str, strategy: str, prompts: list[dict], batch_size: int = 4,
             requests: list | None = None) -> dict:
    """The adapter in the vLLM venv (``python -m actors.engine.vllm_backend``)."""
    cfg = {**_configs()[strategy], "backend": "vllm", "served_model_name": f"vllm-{strategy}",
           "engine_kwargs": {"enforce_eager": True}}
    cfg = EngineConfig(**cfg).model_dump()
    spec = {"config": cfg, "requests": requests or _requests(prompts), "batch_size": batch_size}
    p = subprocess.run([python, "-m", "actors.engine.vllm_backend"], input=json.dumps(spec),
                       capture_output=True, text=True, timeout=900, cwd=REPO, env=vllm_env())
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def side_by_side(heldout_prompts):
    """{strategy: (vllm result, embedded results, seconds)} on N_PROMPTS held-out prompts
    (half code, half prose), greedy, fp32, k = 4, batch 4 on both engines."""
    python = _vllm_python_or_skip()
    from actors.engine.llm_engine import LLMEngine, run_requests

    code = [p for p in heldout_prompts if p["domain"] == "code"][:N_PROMPTS // 2]
    prose = [p for p in heldout_prompts if p["domain"] != "code"][:N_PROMPTS // 2]
    prompts = code + prose
    out = {}
    baseline_lp = None

    def timed_vllm(strategy: str) -> tuple[dict, float]:
        t0 = time.monotonic()
        return run_vllm(python, strategy, prompts), time.monotonic() - t0

    # the three vLLM runs at once, each in its own process (their start-ups overlap), while
    # the embedded engine runs here
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3)
    runs = {strategy: pool.submit(timed_vllm, strategy) for strategy in _configs()}
    for strategy, cfg in _configs().items():
        eng = LLMEngine(EngineConfig(**cfg))
        reqs = [(rid, pr, SamplingParams(**sp)) for rid, pr, sp in
                _requests(prompts, 5 if strategy == "autoregressive" else None)]
        emb = run_requests(eng, reqs, batch_size=4)
        if strategy == "autoregressive":
            baseline_lp = {rid: r["logprobs"] for rid, r in emb.items()}
        out[strategy] = (emb,)
        del eng
    for strategy, fut in runs.items():
        v, tv = fut.result()
        out[strategy] = (v, out[strategy][0], tv)
    pool.shutdown()
    out["_baseline_logprobs"] = baseline_lp
    return out


def _tie_aware(v_ids: list[int], e_ids: list[int], lps: list) -> str:
    """"identical", "tie" (first divergence within 1e-3 nats of the best token, from
    the embedded autoregressive run's top-5 logprobs) or "differs"."""
    from analysis.data.consistency import TIE, classify_divergence, first_divergence

    i = first_divergence(e_ids, v_ids)
    if i is None:
        return "identical"
    if i < len(lps) and i < len(v_ids):
        top = {t[0]: t[3] for t in lps[i].top}
        kind, _ = classify_divergence(top, e_ids[i] if i < len(e_ids) else None, v_ids[i], 1e-3)
        if kind == TIE:
            return "tie"
    return "differs"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model"])
def test_vllm_greedy_outputs_equal_the_embedded_engine(side_by_side, strategy):
    v, emb, tv = side_by_side[strategy]
    lps = side_by_side["_baseline_logprobs"]
    kinds = {rid: _tie_aware(v["results"][rid]["token_ids"], emb[rid]["token_ids"], lps[rid])
             for rid in emb}
    identical = sum(k == "identical" for k in kinds.values())
    ties = sum(k == "tie" for k in kinds.values())

    def tau(stats):
        d = sum(s["num_drafts"] for s in stats)
        return 1 + sum(s["num_accepted_tokens"] for s in stats) / d if d else 1.0

    tau_v = tau([r["stats"] for r in v["results"].values()])
    tau_e = tau([r["stats"].to_dict() for r in emb.values()])
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    same_stats = sum(all(v["results"][rid]["stats"][k] == emb[rid]["stats"].to_dict()[k]
                         for k in keys) for rid in emb)
    sums = {k: (sum(v["results"][rid]["stats"][k] for rid in emb),
                sum(emb[rid]["stats"].to_dict()[k] for rid in emb)) for k in keys}
    print(f"\n{strategy}: identical {identical}/{len(kinds)}, ties {ties}, differ "
          f"{len(kinds) - identical - ties}; tau vLLM {tau_v:.3f} embedded {tau_e:.3f}; "
          f"per-request drafts/accepted equal {same_stats}/{len(emb)}, (vLLM, embedded) {sums}; "
          f"vLLM load {v['load_s']:.1f} s run {v['run_s']:.1f} s (subprocess {tv:.0f} s); "
          f"step rows {len(v['steps'])}")
    assert identical + ties == len(kinds), kinds
    assert identical >= len(kinds) - 1
    if strategy != "autoregressive":
        assert tau_v > 1.0 and tau_e > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["autoregressive", "ngram", "draft_model"])
def test_vllm_step_rows_agree_with_the_outputs(side_by_side, strategy):
    v, _, _ = side_by_side[strategy]
    rows, res = v["steps"], v["results"]
    assert rows and all(tuple(r) == M.STEP_LOG_COLUMNS for r in rows)
    assert {r[M.STEP_MODEL] for r in rows} == {f"vllm-{strategy}"}
    assert {r[M.STEP_STRATEGY] for r in rows} == {strategy}
    out_tokens = sum(len(r["token_ids"]) for r in res.values())
    emitted = sum(r[M.STEP_EMITTED_TOKENS] + r[M.STEP_PREFILL_EMITTED_TOKENS] for r in rows)
    assert emitted == out_tokens
    assert sum(r[M.STEP_PREFILL_EMITTED_TOKENS] for r in rows) == len(res)
    drafts = sum(r["stats"]["num_draft_tokens"] for r in res.values())
    accepted = sum(r["stats"]["num_accepted_tokens"] for r in res.values())
    assert sum(r[M.STEP_DRAFT_TOKENS] for r in rows) == drafts
    # the step rows cap accepted at what users received (stop / max_tokens cuts)
    assert sum(r[M.STEP_ACCEPTED_TOKENS] for r in rows) <= accepted
    for r in rows:
        if r[M.STEP_BATCH_SIZE]:
            assert r[M.STEP_VERIFICATION_TOKENS] >= r[M.STEP_BATCH_SIZE]
    if strategy == "autoregressive":
        assert drafts == 0
    else:
        assert drafts > 0
    mem = v["memory"]
    assert mem["target_weight_bytes"] > 0 and mem["target_kv_allocated_bytes"] > 0
    assert mem["target_kv_peak_tokens"] > 0
    assert (mem["draft_weight_bytes"] > 0) == (strategy == "draft_model")
    assert (mem["draft_kv_allocated_bytes"] > 0) == (strategy == "draft_model")


# ------------------------------------------------ slow: Serve end to end, both routes
VLLM_NAME = "vllm-ngram"
VLLM_NAMES = ("vllm-autoregressive", VLLM_NAME, "vllm-draft_model")
SERVE_PROMPTS = ["def fibonacci(n):\n    ", "The history of the city begins", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def vllm_service():
    """(base_url, startup_s): embedded autoregressive + the three vLLM-backed strategies
    on the embedded models (vllm-ngram small, max_num_seqs 4 and max_waiting 2, to see
    429s) on a free 127.0.0.1 port, one-hop layout; Ray and Serve shut down after."""
    python = _vllm_python_or_skip()
    pytest.importorskip("ray.serve")
    from tests.serve_fixtures import local_service

    env = {"env_vars": dict(REPLICA_ENV)}
    common = {"torch_threads": 1, "dtype": "float32", "max_model_len": 1024}

    def vllm(name, strategy, **kw):
        return {"name": name, "engine": {
            "backend": "vllm", "vllm_python": python, "strategy": strategy, "max_num_seqs": 8,
            "max_waiting": 32, "engine_kwargs": {"enforce_eager": True}, **common, **kw},
            "ray_actor_options": {"num_cpus": 0.3, "runtime_env": env}}

    args = {"strategies": [
        {"engine": {"strategy": "autoregressive", "num_speculative_tokens": 0, "max_num_seqs": 8,
                    "max_waiting": 32, **common},
         "ray_actor_options": {"num_cpus": 0.3, "runtime_env": env}},
        vllm("vllm-autoregressive", "autoregressive", num_speculative_tokens=0),
        vllm(VLLM_NAME, "ngram", num_speculative_tokens=K, max_num_seqs=4, max_waiting=2),
        vllm("vllm-draft_model", "draft_model", draft_model="models/draft",
             num_speculative_tokens=K)],
        "ingress": {"ray_actor_options": {"num_cpus": 0.1, "runtime_env": env}}}
    t0 = time.monotonic()
    with local_service(args) as (base_url, metrics_url):
        yield base_url, time.monotonic() - t0, metrics_url


def mn_prom(name: str) -> str:
    """A specload Prometheus series as Ray exports it (``ray_specload_<name>``)."""
    from actors.serve.deployments import PROM_PREFIX

    return "ray_" + PROM_PREFIX + name


def _path(route: str, model: str, path: str = "completions") -> str:
    return (f"/strategies/{model}" if route == "strategy" else "") + f"/v1/{path}"


@pytest.mark.slow
def test_serve_vllm_strategy_both_routes_errors_health_and_step_log(vllm_service):
    import httpx

    from tests.serve_fixtures import parse_sse

    url, startup_s, metrics_url = vllm_service
    t0 = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as c:
        models = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert {"autoregressive", *VLLM_NAMES} <= models
        routes = c.get("/specload/routes").json()["routes"]
        assert all(routes[n] == f"/strategies/{n}" for n in VLLM_NAMES), routes
        for route in ("strategy", "model-field"):
            for prompt in SERVE_PROMPTS:
                body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
                e = c.post(_path(route, "autoregressive"), json={**body, "model": "autoregressive"})
                assert e.status_code == 200, e.text
                for name in VLLM_NAMES:
                    v = c.post(_path(route, name), json={**body, "model": name})
                    assert v.status_code == 200, v.text
                    # greedy fp32: each vLLM strategy = the embedded target's own greedy text
                    assert v.json()["choices"][0]["text"] == e.json()["choices"][0]["text"], name
                    assert v.json()["usage"]["completion_tokens"] == 24
            chat = c.post(_path(route, VLLM_NAME, "chat/completions"), json={
                "model": VLLM_NAME, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8, "temperature": 0})
            assert chat.status_code == 200, chat.text
            # same validation and OpenAI-style errors as the embedded engine
            bad = c.post(_path(route, VLLM_NAME), json={"model": VLLM_NAME, "prompt": "x",
                                                         "max_tokens": -1})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
            empty = c.post(_path(route, VLLM_NAME), json={"model": VLLM_NAME, "prompt": "",
                                                           "max_tokens": 4})
            assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
            # streaming (ngram steps carry several tokens)
            with c.stream("POST", _path(route, VLLM_NAME), json={
                    "model": VLLM_NAME, "prompt": SERVE_PROMPTS[2] * 3, "max_tokens": 32,
                    "temperature": 0, "stream": True}) as s:
                events = parse_sse(s.iter_lines())
            assert events[-1] == "[DONE]"
            # the engine emits once per step (token_ts: each token's step time; chunks that
            # queued while the replica was busy are merged, so count steps, not chunks)
            ts = [t for ev in events[:-1] if ev["choices"] for t in ev["choices"][0].get("token_ts") or []]
            assert len(ts) == 32
            per_step = [ts.count(t) for t in sorted(set(ts))]
            assert 1 < len(per_step) <= 32 and max(per_step) <= K + 1, per_step
        # logprobs: the target's, as the embedded engine reports them (greedy fp32)
        lp = {}
        for name in ("autoregressive", VLLM_NAME):
            r = c.post(_path("strategy", name), json={"model": name, "prompt": SERVE_PROMPTS[0],
                                                      "max_tokens": 8, "temperature": 0,
                                                      "logprobs": 2})
            assert r.status_code == 200, r.text
            lp[name] = r.json()["choices"][0]["logprobs"]
        assert lp[VLLM_NAME]["tokens"] == lp["autoregressive"]["tokens"]
        assert lp[VLLM_NAME]["token_logprobs"] == pytest.approx(
            lp["autoregressive"]["token_logprobs"], abs=1e-3)
        assert [len(t) for t in lp[VLLM_NAME]["top_logprobs"]] == [
            len(t) for t in lp["autoregressive"]["top_logprobs"]]
        health = c.get("/health")
        assert health.status_code == 200, health.text
        assert c.get(f"/strategies/{VLLM_NAME}/health").status_code == 200
        # 429 beyond max_waiting (4 running + 2 waiting), bounded: 12 requests at once
        import concurrent.futures as cf

        def one(i):
            return c.post(_path("strategy", VLLM_NAME), json={
                "model": VLLM_NAME, "prompt": f"{i} " + SERVE_PROMPTS[1], "max_tokens": 96,
                "temperature": 0, "ignore_eos": True}).status_code

        with cf.ThreadPoolExecutor(12) as ex:
            codes = list(ex.map(one, range(12)))
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        time.sleep(1.5)   # the step-log push period (0.5 s) and a margin
        n_rows = {}
        for name in VLLM_NAMES:
            rows = c.get("/specload/step_log", params={"strategy": name}).json()["rows"]
            assert rows and {r[M.STEP_MODEL] for r in rows} == {name}
            n_rows[name] = len(rows)
            drafts = sum(r[M.STEP_DRAFT_TOKENS] for r in rows)
            assert (drafts == 0) if name == "vllm-autoregressive" else (
                drafts > 0 and sum(r[M.STEP_ACCEPTED_TOKENS] for r in rows) > 0), name
        mem = c.get("/specload/memory", params={"strategy": "vllm-draft_model"}).json()
        rep = mem["vllm-draft_model"]
        assert rep["target_weight_bytes"] > 0 and rep["target_kv_allocated_bytes"] > 0
    # the same Prometheus series as the embedded engine's, labelled with the served name
    import urllib.request

    want = [mn_prom(M.PROM_SPEC_NUM_DRAFTS), mn_prom(M.PROM_STEP_TIME_MS),
            mn_prom(M.PROM_BATCH_SIZE)]
    seen, deadline = False, time.monotonic() + 40
    while not seen and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(metrics_url, timeout=10) as r:  # noqa: S310
                lines = r.read().decode().splitlines()
            seen = all(any(line.startswith(w) and f'strategy="{VLLM_NAME}"' in line
                           for line in lines) for w in want)
        except OSError:
            pass
        if not seen:
            time.sleep(2)
    assert seen, f"not all of {want} exported for {VLLM_NAME}"
    print(f"\nServe with {VLLM_NAME}: started in {startup_s:.0f} s; requests checks "
          f"{time.monotonic() - t0:.0f} s; step rows {n_rows}; 429s {codes.count(429)}/12; "
          f"memory vllm-draft_model: weights {rep['target_weight_bytes']} + draft "
          f"{rep['draft_weight_bytes']} B, KV allocated {rep['target_kv_allocated_bytes']} B")


@pytest.mark.slow
@pytest.mark.parametrize("route", ["strategy", "model-field"])
def test_loadgen_measures_embedded_and_vllm_side_by_side(vllm_service, tmp_path, route):
    import pandas as pd

    from tests.tiers_file import write_tiers

    url, _, _ = vllm_service
    names = ["autoregressive", *VLLM_NAMES] if route == "strategy" else [VLLM_NAME]
    tiers = write_tiers(tmp_path, {"arrival": "closed", "users": 2, "spawn_rate": 2,
                                   "duration_s": 3, "max_tokens": 32,
                                   "slo": {"ttft_ms": 5000, "tpot_ms": 500}},
                        request_timeout_s=60, drain_timeout_s=30, seed=0, max_prompt_chars=600,
                        sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0})
    cmd = [sys.executable, "-m", "loadgen", "--target", url, "--strategies", ",".join(names),
           "--route", route, "--tier", "low", "--output", "short",
           "--tiers-file", str(tiers), "--consistency", "0", "--results", str(tmp_path),
           "--run-id", "run", "--report"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                                             "COLUMNS": "200"},
                       capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = tmp_path / "run"
    steps = pd.read_parquet(run / "steps.parquet")
    req = pd.read_parquet(run / "requests.parquet")
    by = steps.groupby(M.STEP_MODEL).size().to_dict()
    assert all(by.get(n, 0) > 0 for n in names), by
    v = steps[steps[M.STEP_MODEL].eq(VLLM_NAME)]
    assert int(v[M.STEP_DRAFT_TOKENS].sum()) > 0
    ok = req[req[M.REQ_STATUS].eq(M.STATUS_OK)]
    assert set(ok[M.REQ_STRATEGY]) == set(names)
    manifest = json.loads((run / "manifest.json").read_text())
    assert {r["route"] for r in manifest["routes"].values()} == {route}, manifest["routes"]
    from analysis.data.load import load_results
    from analysis.report.build import analyse

    a = analyse(load_results(run))
    cells = a.cells.set_index(M.REQ_STRATEGY)
    cap = a.capacity.set_index(M.STEP_STRATEGY)
    assert VLLM_NAME in cells.index and VLLM_NAME in cap.index
    md = (run / "report" / "report.md").read_text()
    assert all(n in md for n in names)
    print(f"\nloadgen ({route} route) side by side: {wall:.0f} s; step rows {by}; requests ok "
          f"{ok.groupby(M.REQ_STRATEGY).size().to_dict()}; tau {VLLM_NAME} "
          f"{cells.loc[VLLM_NAME, M.ACCEPTANCE_LENGTH]:.3f}; capacity rows\n"
          f"{cap.to_string()[:1500]}")


@pytest.mark.slow
def test_vllm_stop_strings_min_tokens_and_ignore_eos_as_the_embedded_engine():
    """Greedy, ngram: stop strings, min_tokens (stop strings only after them) and
    ignore_eos give the embedded engine's tokens, text and finish reasons."""
    from actors.engine.llm_engine import LLMEngine, run_requests

    python = _vllm_python_or_skip()
    reqs = [["stop", "def f(x):\n    return x\n\ndef g(y):\n", {"max_tokens": 40, "stop": ["\n\n"]}],
            ["min", "def f(x):\n", {"max_tokens": 20, "min_tokens": 10, "stop": ["\n"]}],
            ["eos", "hello", {"max_tokens": 12, "ignore_eos": True}],
            ["ids", [5, 6, 7, 8, 9, 10], {"max_tokens": 10}]]
    v = run_vllm(python, "ngram", [], batch_size=4, requests=reqs)["results"]
    eng = LLMEngine(EngineConfig(**_configs()["ngram"]))
    e = run_requests(eng, [(r, p, SamplingParams(**sp)) for r, p, sp in reqs], batch_size=4)
    for rid in e:
        assert v[rid]["token_ids"] == e[rid]["token_ids"], rid
        assert v[rid]["text"] == e[rid]["text"], rid
        assert v[rid]["finish_reason"] == e[rid]["finish_reason"], rid
    assert e["stop"]["finish_reason"] == "stop"
