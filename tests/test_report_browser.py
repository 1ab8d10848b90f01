"""A generated report opened in a real headless browser renders with every image."""

import os
import re
import shutil
import subprocess

import pytest

from moesim.hardware import get_profile
from moesim.models import get_model
from moesim.reports.replay import write_replay_report
from moesim.sim.simulate import simulate
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
def test_report_renders_in_headless_chromium(tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium for the browser test (.ci/run does)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    trace = synthetic_trace(get_model("olmoe-1b-7b"), SyntheticParams(tokens=8))
    hw = get_profile("a6000")
    results = [simulate(trace, hw, p) for p in ("on-demand", "prefetch-fom")]
    page = write_replay_report(trace, tmp_path / "t.npz", hw, results, tmp_path / "report", 1)
    n_images = page.read_text().count("<img ")
    assert n_images >= 2
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r"images rendered: (\d+)/(\d+)", dom.stdout)
    assert m, dom.stderr[-2000:]
    assert int(m.group(1)) == int(m.group(2)) == n_images
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 10_000  # a page with figures, not a blank one
