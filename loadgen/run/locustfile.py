"""Locust entry point: ``locust -f loadgen/run/locustfile.py --host URL`` (web UI or --headless).

Standalone use (Locust's own CLI / web UI): pick the cell with custom options or
environment variables; timing is recorded in Locust's stats (``<strategy> e2e``
and ``<strategy> ttft`` rows, ms). For per-request Parquet rows, the specload
runner and the report, use ``python -m loadgen`` instead.

    --specload-model NAME      strategy / model id sent as "model" (env SPECLOAD_MODEL, default autoregressive)
    --specload-tier low|mid|high        (env SPECLOAD_TIER, default low)   -> max_tokens, sampling
    --specload-output short|long        (env SPECLOAD_OUTPUT, default short)
    --specload-profile NAME             (env SPECLOAD_PROFILE, default: the file's default profile)
    --specload-dataset NAME|FILE.jsonl  (env SPECLOAD_DATASET, default mixed)
    --specload-tiers-file FILE          (env SPECLOAD_TIERS_FILE, default configs/tiers.yaml)

Users loop closed-loop (the tier's open-loop arrival is not used here; Locust's
``-u`` / ``-r`` set users and spawn rate). The same file is what
``python -m loadgen --workers N`` starts as ``locust --worker``: there the
master sends each cell's plan and this file only streams rows back.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# `locust -f loadgen/run/locustfile.py` puts loadgen/ (not the repo root) on sys.path
_ROOT = str(Path(__file__).resolve().parents[2])  # bootstrap: locust loads this file by path
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from locust import events  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from loadgen.run.cells import CellPlan, shuffled_prompts  # noqa: E402
from loadgen.run.users import CellContext, CompletionUser, install_worker_hooks  # noqa: E402

__all__ = ["CompletionUser"]

_OPTIONS = (("model", "SPECLOAD_MODEL", "autoregressive"), ("tier", "SPECLOAD_TIER", "low"),
            ("output", "SPECLOAD_OUTPUT", "short"), ("profile", "SPECLOAD_PROFILE", ""),
            ("dataset", "SPECLOAD_DATASET", "mixed"), ("tiers_file", "SPECLOAD_TIERS_FILE", ""))


@events.init_command_line_parser.add_listener
def _add_options(parser, **_):
    for name, env, default in _OPTIONS:
        parser.add_argument(f"--specload-{name.replace('_', '-')}", type=str, env_var=env,
                            default=os.environ.get(env, default), help=f"specload {name} (env {env})")


def standalone_plan(environment) -> CellPlan:
    """A never-ending closed-loop cell from the --specload-* options (Locust CLI use)."""
    from configs.tiers import load_tiers
    from loadgen.run.datasets import load_dataset

    o = environment.parsed_options
    get = (lambda n, d: getattr(o, f"specload_{n}", d) if o is not None else d)
    tiers = load_tiers(get("tiers_file", "") or None)
    profile = tiers.profile(get("profile", "") or None)
    cell = profile.cell(get("tier", "low"), get("output", "short"))
    dataset = get("dataset", "mixed")
    prompts = shuffled_prompts(load_dataset(dataset, profile.max_prompt_chars), profile.seed)
    now = time.time()
    return CellPlan(run_id="locust-cli", strategy=get("model", "autoregressive"), model=get("model", "autoregressive"),
                    tier=get("tier", "low"), output_class=get("output", "short"), dataset=dataset,
                    base_url=environment.host or CompletionUser.host, arrival="closed", users=cell.users,
                    rate_rps=None, start_ts=now, deadline_ts=float("inf"),
                    prompts=[[p.prompt_id, p.text, p.max_tokens] for p in prompts],
                    max_tokens=cell.max_tokens.model_dump(), seed=profile.seed,
                    sampling=profile.sampling.model_dump(), extra_body=dict(profile.extra_body),
                    request_timeout_s=profile.request_timeout_s, cell_id="locust-cli")


@events.init.add_listener
def _on_init(environment, **_):
    if isinstance(environment.runner, WorkerRunner) and os.environ.get("SPECLOAD_WORKER") == "1":
        install_worker_hooks(environment)  # started by `python -m loadgen --workers N`


@events.test_start.add_listener
def _on_test_start(environment, **_):
    if os.environ.get("SPECLOAD_WORKER") == "1" or getattr(environment, "specload", None) is not None:
        return
    if isinstance(environment.runner, WorkerRunner) or environment.runner is None or \
            type(environment.runner).__name__ == "LocalRunner":
        environment.specload = CellContext(standalone_plan(environment), sink=lambda row: None)
