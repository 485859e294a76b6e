"""One load run of a campaign: ``python -m loadgen`` against a URL, into a fresh run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from configs.paths import PACKAGE_ROOT


def run_loadgen(url: str, flags: list[str], results: Path, run_id: str,
                timeout_s: float = 3600) -> Path:
    """Run ``python -m loadgen FLAGS --target URL --results RESULTS --run-id RUN_ID`` (cwd: the
    package root) and return ``RESULTS/RUN_ID``.

    ``flags``: the rest of the load generator's command line (``--tier``, ``--output``,
    ``--strategies``, ``--tiers-file`` ...). Raises RuntimeError with the output's tail when
    it exits non-zero or wrote no ``requests.parquet``."""
    cmd = [sys.executable, "-m", "loadgen", *flags, "--target", url, "--results", str(results),
           "--run-id", run_id]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=PACKAGE_ROOT)
    run_dir = Path(results) / run_id
    if p.returncode != 0 or not (run_dir / "requests.parquet").is_file():
        raise RuntimeError(f"loadgen failed (exit {p.returncode}) or wrote no requests: "
                           f"{(p.stdout + p.stderr)[-1500:]}")
    return run_dir
