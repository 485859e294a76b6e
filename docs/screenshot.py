"""The README's picture: a run's real HTML report, drawn by headless Chromium.

    python docs/screenshot.py RUN_DIR [--out docs/img/report.png] [--width 1280 --height 1800]

RUN_DIR is a run directory of ``python -m loadgen ... --report`` (or one that
``python -m analysis report RUN_DIR`` has written ``report/report.html`` into). The page is
self-contained (figures inlined), so Chromium opens it from disk with no server. Needs
Debian's ``chromium`` (``apt-get install -y chromium``). Exits 2 naming the argument when
the run has no report or Chromium is missing.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "img" / "report.png"


def screenshot(html: Path, out: Path, width: int, height: int, timeout_s: float = 120) -> Path:
    """Draw ``html`` at ``width`` x ``height`` CSS pixels into the PNG ``out``.
    Raises RuntimeError with Chromium's stderr when it writes no picture."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise FileNotFoundError("chromium not found: apt-get install -y chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:   # a private profile: no shared state
        p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--hide-scrollbars", f"--user-data-dir={profile}",
                            f"--window-size={width},{height}", f"--screenshot={out}",
                            html.resolve().as_uri()],
                           capture_output=True, text=True, timeout=timeout_s)
    if not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no picture (exit {p.returncode}): {p.stderr[-1000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/screenshot.py", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory with report/report.html")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write")
    ap.add_argument("--width", type=int, default=1280, help="CSS pixels")
    ap.add_argument("--height", type=int, default=1800, help="CSS pixels")
    a = ap.parse_args(argv)
    html = a.run_dir / "report" / "report.html"
    if not html.is_file():
        ap.error(f"run_dir: {html} does not exist (run `python -m analysis report {a.run_dir}`)")
    try:
        print(screenshot(html, a.out, a.width, a.height))
    except FileNotFoundError as err:
        ap.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
