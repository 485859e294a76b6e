"""The engine profile after the cells: ``python -m actors.profile`` on the run's own
strategies, written beside the run as ``RUN_DIR/cost_curve.json`` (the capacity model's
profiled step cost, ``analysis.model.profiled``).

Taken only where the engine is this machine's: the local service (no ``--target``), with
``--engine-profile auto`` (the default). It runs in a child process after the last cell, on
the same build and hardware as the run, while the service idles; a failure or a timeout
is a warning in the console and in ``manifest["engine_profile"]``, never a lost run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROFILE_FILE = "cost_curve.json"    # analysis.model.profiled.PROFILE_FILE
TIMEOUT_S = 1800.0   # embedded ~8 s a strategy; vLLM 1-4 min each (its engine load)


def wanted(args: Any, status: str) -> str | None:
    """None when the profile is to be taken, else why not (a sentence)."""
    if getattr(args, "engine_profile", "auto") == "off":
        return "--engine-profile off"
    if args.target:
        return "the target is not this machine's local service (--target): profile its engine " \
               "there with `python -m actors.profile --out RUN_DIR/cost_curve.json`"
    if status == "interrupted":
        return "the run was interrupted"
    return None


def take(run_dir: Path, strategies: list[str], serve_config: str, say, timeout_s: float = TIMEOUT_S
         ) -> dict[str, Any]:
    """Profile ``strategies`` (those of the Serve config with an embedded or a vLLM engine;
    the rest are skipped) into ``run_dir/cost_curve.json``. Returns the manifest's record: {"file" (None
    on failure), "strategies", "seconds", "error"}."""
    cmd = [sys.executable, "-m", "actors.profile", "--out", str(run_dir / PROFILE_FILE),
           "--strategies", ",".join(strategies), "--skip-missing"]
    if serve_config:
        cmd += ["--serve-config", str(serve_config)]
    say(f"engine profile: timing the run's engines on this machine for the capacity model "
        f"(about 8 s per embedded strategy, 1-4 min per vLLM one; --engine-profile off skips it)")
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"file": None, "strategies": [], "seconds": round(time.monotonic() - t0, 1),
                "error": f"timed out after {timeout_s:.0f} s"}
    secs = round(time.monotonic() - t0, 1)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return {"file": None, "strategies": [], "seconds": secs,
                "error": f"exit {done.returncode}: {tail[0][:300]}"}
    got = [ln.split(": ", 1)[1].split(" in ", 1)[0] for ln in (done.stderr or "").splitlines()
           if ln.startswith("engine profile: ") and " in " in ln]
    if not (run_dir / PROFILE_FILE).is_file():
        return {"file": None, "strategies": [], "seconds": secs,
                "error": "no strategy of the run has an embedded or vLLM engine in the Serve config"}
    return {"file": PROFILE_FILE, "strategies": got, "seconds": secs, "error": None}
