"""The HTML report opened in headless Chromium (Debian ``chromium``; .ci/run installs it):
no console errors, every plot decodes, the recommendation table is present."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from analysis.report.build import build_report
from tests import analysis_synth as syn
from tests.cdp_client import CHROMIUM, Browser

pytestmark = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                reason=f"{CHROMIUM} absent: apt-get install -y chromium")

PROBE = """(async () => {
  const imgs = Array.from(document.images);
  const decoded = await Promise.all(imgs.map(i => i.decode().then(() => true, () => false)));
  const rec = document.querySelector('table#recommendation');
  return {n: imgs.length, decoded, widths: imgs.map(i => i.naturalWidth),
          ids: imgs.map(i => i.id), rec: !!rec,
          rows: rec ? Array.from(rec.querySelectorAll('tbody tr'))
                        .map(r => Array.from(r.cells).map(c => c.textContent)) : [],
          external: Array.from(document.querySelectorAll('[src],[href]'))
                        .map(e => e.getAttribute('src') || e.getAttribute('href'))
                        .filter(u => !u.startsWith('data:'))};
})()"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def test_report_renders_in_chromium(tmp_path, browser):
    syn.write_run(tmp_path / "run")
    paths = build_report(tmp_path / "run", tmp_path / "out")["paths"]
    browser.open(f"file://{paths['html']}")
    got = browser.evaluate(PROBE)
    assert browser.errors == []
    # every figure the page embeds is seen by the browser, decodes and has a real width
    written = re.findall(r'<img id="(fig-[^"]+)"', Path(paths["html"]).read_text())
    assert got["ids"] == written and got["n"] == len(written) >= 8
    assert all(got["decoded"]) and min(got["widths"]) > 100
    assert {"fig-per_position", "fig-step_cost", "fig-step_residuals", "fig-goodput"} <= set(got["ids"])
    assert got["rec"] and len(got["rows"]) == 6
    by_tier = {(r[0], r[1]): r[3] for r in got["rows"]}
    assert by_tier[("low", "short")] == "dflash" and by_tier[("high", "long")] == "autoregressive"
    assert got["external"] == []


def test_probe_catches_broken_images_and_console_errors(tmp_path, browser):
    """Negative control: the harness must see a broken image and a console error."""
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><img src="data:image/png;base64,AAAA">'
                    '<script>console.error("boom")</script></body></html>')
    browser.errors.clear()
    browser.open(f"file://{page}")
    got = browser.evaluate(PROBE)
    assert got["decoded"] == [False] and got["widths"] == [0] and not got["rec"]
    assert any(kind == "console" and "boom" in text for kind, text in browser.errors)
