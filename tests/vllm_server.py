"""The tests' side of ``cluster.vllm_server``: the vLLM venv or a skip.

Without the vLLM venv the tests skip, saying how to make it; with
``SPECLOAD_REQUIRE_VLLM=1`` (``.ci/run`` sets it) they fail instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.vllm_server import (DRAFT, DRAFT_MODEL, ENV_PYTHON, NGRAM, REPO, TARGET,  # noqa: F401
                                VllmServer,
                                find_vllm_python)
from cluster.vllm_server import start_servers as _start_servers

ENV_REQUIRE = "SPECLOAD_REQUIRE_VLLM"
# What the tests' vLLM servers start with: no torch.compile warm-up (--enforce-eager) and the
# model in the engine-core process (no worker process). They read what vLLM reports and
# returns, not its speed; bench.vs_vllm keeps vLLM's defaults.
FAST_START = {"extra": ["--enforce-eager"], "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def vllm_python() -> str:
    """The vLLM venv's interpreter; skips (or fails under SPECLOAD_REQUIRE_VLLM=1) without one."""
    try:
        return find_vllm_python()
    except FileNotFoundError as err:
        if os.environ.get(ENV_REQUIRE) == "1":
            pytest.fail(f"{ENV_REQUIRE}=1 but {err}")
        pytest.skip(str(err))


def start_servers(servers: list[VllmServer], log_dir: Path) -> list[VllmServer]:
    """``cluster.vllm_server.start_servers`` with the venv found (or the test skipped)."""
    return _start_servers(servers, log_dir, vllm_python())
