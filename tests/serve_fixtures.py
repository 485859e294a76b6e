"""Helpers for the Serve tests: a local Ray + Serve app on a free loopback port.

The real engine (``actors.engine.llm_engine.LLMEngine`` on ``models/target``) is used
when it and the model weights exist and ``SPECLOAD_TEST_FAKE_ENGINE`` is not
"1"; otherwise ``tests.fake_engine`` stands in (same API, deterministic).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ONE_SLOT = "one-slot"     # a 1-slot, 1-waiting deployment for overload / disconnect tests


def use_real_engine() -> bool:
    return (os.environ.get("SPECLOAD_TEST_FAKE_ENGINE") != "1"
            and (REPO / "actors" / "engine" / "llm_engine.py").exists()
            and (REPO / "models" / "target" / "model.safetensors").exists())


def app_args(real: bool) -> dict:
    """ServeAppConfig args for the test app: every servable strategy + ONE_SLOT."""
    common = {"max_num_seqs": 8, "max_waiting": 32, "torch_threads": 1}
    fake = {} if real else {"max_model_len": 4096, "step_ms": 4}
    strategies = [
        {"engine": {"strategy": "autoregressive", "num_speculative_tokens": 0, **common, **fake},
         "ray_actor_options": {"num_cpus": 0.3}},
        {"engine": {"strategy": "ngram", "num_speculative_tokens": 4, **common, **fake},
         "ray_actor_options": {"num_cpus": 0.3}},
        {"name": ONE_SLOT,
         "engine": {"strategy": "autoregressive", "num_speculative_tokens": 0,
                    "max_num_seqs": 1, "max_waiting": 1, "torch_threads": 1,
                    **({} if real else {"max_model_len": 4096, "step_ms": 10})},
         "ray_actor_options": {"num_cpus": 0.2}},
    ]
    if real and (REPO / "models" / "draft" / "model.safetensors").exists():
        strategies.insert(1, {"engine": {"strategy": "draft_model", "draft_model": "models/draft",
                                         "num_speculative_tokens": 4, **common},
                              "ray_actor_options": {"num_cpus": 0.3}})
    args: dict = {"strategies": strategies,
                  "ingress": {"ray_actor_options": {"num_cpus": 0.1}}}
    # As configs/serve.yaml's runtime_env: gRPC handles, user code on the replica loop.
    for opts in [s["ray_actor_options"] for s in strategies] + [
            args["ingress"]["ray_actor_options"]]:
        opts["runtime_env"] = {"env_vars": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
                                            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
    if not real:
        args["engine_factory"] = "tests.fake_engine:make_fake_engine"
    return args


def parse_sse(lines) -> list[dict | str]:
    """``data:`` payloads of an SSE body: dicts, and the string "[DONE]"."""
    out: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
