"""One import name: a built wheel installs only ``moesim``, and works from there.

The wheel is built from this source tree and unpacked into a fresh target folder; the
checks run in a subprocess whose path puts that folder first and whose working directory
is outside the repository, so nothing from the checkout can be imported by accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"building the wheel failed: {r.stderr[-2000:]}")
    (whl,) = out.glob("moesim-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:  # a wheel is a zip of the install tree (pure Python)
        z.extractall(target)
    return target


def run_installed(target: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=target.parent, env=env,
                          timeout=300)


def test_wheel_adds_only_the_moesim_import_name(wheel):
    with zipfile.ZipFile(wheel) as z:
        top = {n.split("/")[0] for n in z.namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"moesim"}


def test_wheel_ships_profiles_checkpoints_and_example_data(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert "moesim/hwprofiles/h200.toml" in names
    assert "moesim/executor/checkpoints/moe-stdlib/model.safetensors" in names
    assert "moesim/executor/checkpoints/moe-stdlib-draft/expert_predictor.safetensors" in names


def test_installed_package_imports_under_one_name_and_finds_its_data(installed):
    code = (
        "import importlib.util, moesim, moesim.sim, moesim.traces, moesim.executor, moesim.reports, moesim.hwprofiles\n"
        "from pathlib import Path\n"
        "root = Path(moesim.__file__).parent\n"
        "for m in (moesim.sim, moesim.traces, moesim.executor, moesim.reports, moesim.hwprofiles):\n"
        "    assert Path(m.__file__).is_relative_to(root), m.__file__\n"
        "for name in ('sim', 'traces', 'executor', 'reports', 'hwprofiles'):\n"
        "    assert importlib.util.find_spec(name) is None, name + ' is importable at top level'\n"
        "from moesim.hardware import get_profile\n"
        "print(get_profile('h200').name)\n"
    )
    r = run_installed(installed, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "h200"


def test_installed_cli_runs(installed):
    r = run_installed(installed, "import sys; sys.argv = ['moesim', 'models', '--json']; "
                                 "from moesim.cli import main; main()")
    assert r.returncode == 0, r.stderr
    assert "qwen3-30b-a3b" in r.stdout


def _compile_in_a_fresh_cache(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` with numba's cache in ``tmp_path/cache`` (MOESIM_CACHE_DIR, empty) and check
    that compiled kernels landed there and none next to the package's sources."""
    import time

    start = time.time() - 1
    env = {**os.environ, "MOESIM_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "cache").rglob("*.nbi")), "no compiled kernel was cached in MOESIM_CACHE_DIR"
    import moesim

    package = Path(moesim.__file__).resolve().parent
    fresh = [p for folder in (package, package.parent / "sim", package / "sim") if folder.is_dir()
             for p in folder.rglob("*.nbi") if p.stat().st_mtime > start]
    assert not fresh, fresh
    return r


def test_compiled_kernels_are_cached_outside_the_package(tmp_path):
    """numba's cache goes to the user cache folder (moesim.jit), not next to the source: in
    an installed package those files outlived `pip uninstall` and shadowed the next install.
    Every kernel's cache folder is checked; one small kernel is compiled for real (compiling
    them all, as a first simulate does, is the slow test below: 15 s)."""
    code = ("import json, numpy as np; from moesim.policy import kernel as policy_kernel; from moesim.sim import fastpath_kernel, stats; "
            "from moesim.traces import synthetic\n"
            "names = ['_routing_pass', '_recall_pass', '_lru_segments', '_online', '_distinct', '_next_uses', '_belady']\n"
            "kernels = [policy_kernel.plan_steps, fastpath_kernel.recurrence, synthetic._kernel(), "
            "*(stats._kernel(n) for n in names)]\n"
            "assert stats._kernel('_distinct')(np.zeros((2, 2, 2), np.int16), 4) == 2\n"
            "print(json.dumps([k._cache._cache_path for k in kernels]))")
    r = _compile_in_a_fresh_cache(tmp_path, code)
    cache = (tmp_path / "cache").resolve()
    folders = json.loads(r.stdout)
    assert len(folders) == 10 and all(Path(f).resolve().is_relative_to(cache) for f in folders), folders


@pytest.mark.slow
def test_a_first_simulate_caches_its_kernels_outside_the_package(tmp_path):
    _compile_in_a_fresh_cache(tmp_path, (
        "from moesim.models import get_model; from moesim.traces.synthetic import SyntheticParams, synthetic_trace; "
        "from moesim.sim.simulate import simulate; from moesim.setting import Setting; from moesim.hardware import get_profile; "
        "t = synthetic_trace(get_model('tiny'), SyntheticParams(tokens=4)); "
        "simulate(t, get_profile('a6000'), 'prefetch-fom', Setting(sim='fast'))"))


@pytest.mark.slow
def test_a_first_whatif_compiles_the_planner_aside_and_loads_it_from_the_cache(tmp_path):
    """The first run's planner kernel is compiled by a forked process while the traces are
    drawn (sim/whatif.compile_kernels_aside): the sweep then loads it from numba's cache (a
    hit, no compile of its own) and gives the rows a run without it gives."""
    r = _compile_in_a_fresh_cache(tmp_path, (
        "import json; from moesim.policy import kernel as policy_kernel; from moesim.sim.whatif import WhatifOptions, whatif\n"
        "kw = dict(models=['olmoe-1b-7b'], hws=['a6000'], policies=['on-demand', 'prefetch-fom'], tokens=4, jobs=2)\n"
        "res = whatif(WhatifOptions(**kw))\n"
        "stats = policy_kernel.plan_steps.stats\n"
        "print(json.dumps([sum(stats.cache_hits.values()), sum(stats.cache_misses.values()), "
        "[x['tpot_ms'] for x in res.rows]]))"))
    hits, misses, rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert (hits, misses) == (1, 0), r.stdout
    import numpy as np

    from moesim.sim.whatif import WhatifOptions, whatif

    same = whatif(WhatifOptions(models=["olmoe-1b-7b"], hws=["a6000"], policies=["on-demand", "prefetch-fom"], tokens=4, jobs=1))
    assert np.allclose(rows, [x["tpot_ms"] for x in same.rows], rtol=1e-12)
