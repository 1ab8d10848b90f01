"""`moesim whatif` as the deployment answer: CPU-policy rows equal `moesim replay`'s, the
family axes, the answer table, crossover detection, bad axes, and resuming with CPU rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_run import runners

from moesim.errors import MoesimError
from moesim.fmt import number
from moesim.hardware import get_host, get_profile
from moesim.models import get_model
from moesim.sim.answer import crossovers, deployment_answer, format_answer
from moesim.sim.sweep import ROW_COLUMNS, Sweep, run_sweep
from moesim.sim.whatif import WhatifOptions, whatif
from moesim.traces.format import write_trace
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

RTOL = 1e-6  # fast path against the SimPy reference (tests/test_sim.py holds the engines to this)


def moesim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


#: ``cli``: in-process by default, this module's subprocess with -m slow (see cli_run.runners)
BOTH_WAYS = runners(moesim)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A synthetic olmoe trace and a separate calibration trace (another seed), on disk."""
    d = tmp_path_factory.mktemp("traces")
    spec = get_model("olmoe-1b-7b")
    run = write_trace(synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=16, seed=5)), d / "run.npz")
    calib = write_trace(synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=16, seed=6)), d / "calib.npz")
    return run, calib


def _by_policy(rows):
    return {r["policy"]: r for r in rows}


@pytest.mark.parametrize("cli", BOTH_WAYS)
def test_cpu_policy_rows_equal_replay(traces, tmp_path, cli):
    """The same configuration through `moesim replay` (SimPy reference) and `moesim whatif`
    (fast path) gives the same TPOT, TTFT, CPU time and memory verdict."""
    run, calib = traces
    common = ["--hw", "a6000", "--host", "xeon-8480", "--cpu-layers", "6", "--placement-from", calib,
              "--cache-gib", "1", "--link-gbps", "12", "--json"]
    pols = "cpu-static,hot-experts,cpu-on-miss"
    rep = cli("replay", run, "--policy", pols, "--sim", "simpy", *common)
    assert rep.returncode == 0, rep.stderr
    wi = cli("whatif", "--trace", run, "--policy", pols, "--jobs", "1", "--out", tmp_path / "r", *common)
    assert wi.returncode == 0, wi.stderr
    want, got = _by_policy(json.loads(rep.stdout)), _by_policy(json.loads(wi.stdout)["rows"])
    assert set(got) == set(pols.split(","))
    for p in got:
        assert got[p]["host"] == want[p]["host"] == "xeon-8480"
        # Static placements: the static step model in the sweep, the SimPy reference in replay.
        assert got[p]["sim"] == ("fast" if p == "cpu-on-miss" else "static") and want[p]["sim"] == "simpy"
        for k in ("tpot_ms", "tpot_p99_ms", "ttft_ms", "cpu_ms", "copy_ms", "compute_ms"):
            assert got[p][k] == pytest.approx(want[p][k], rel=RTOL), (p, k)
        for k in ("fits", "device_gb_needed", "resident_experts", "cache_experts"):
            assert got[p][k] == want[p][k], (p, k)
    assert "calibration trace" in got["hot-experts"]["note"]


def test_copy_axes_equal_replay(traces):
    """A non-fifo copy queue runs on SimPy (the row says so) and equals replay's; an expert
    format and a prefetch top-M transform the trace as replay does."""
    from moesim.sim.replay import TraceChanges, replay, replay_setting

    run, _ = traces
    want = replay(run, "h100-sxm", ["prefetch-fom"], replay_setting(sim="simpy", copy_queue="demand-first"), TraceChanges(expert_dtype="int8", prefetch_top=4)).rows[0]
    (got,) = whatif(WhatifOptions(run, hws=["h100-sxm"], policies=["prefetch-fom"], cache_gib=[0], expert_dtypes=["int8"],
                    prefetch_top=[4], copy_queues=["demand-first"], jobs=1)).rows
    assert got["sim"] == "simpy"  # the fast path has no copy queues: never a silent substitute
    assert (got["copy_queue"], got["prefetch_top"], got["expert_dtype"]) == ("demand-first", 4, "int8")
    assert got["model"] == want["model"] == "olmoe-1b-7b@int8"
    for k in ("tpot_ms", "ttft_ms", "copy_ms", "stall_ms", "gb_moved_per_token", "pred_recall"):
        assert got[k] == pytest.approx(want[k], rel=1e-12), k


def test_synthetic_hot_experts_place_from_a_second_synthetic_trace(tmp_path):
    """Without --trace, hot-experts places by a calibration twin of the swept trace (its
    expert popularity, other draws), never the swept one: on a GPU that holds part of the
    experts, the row equals `replay --placement-from` that twin and differs from placing by
    the swept trace itself; and the placement finds the popular experts, so the device hit
    rate beats the resident share (a random placement's: the bug this fixes)."""
    from moesim.sim.replay import TraceChanges, replay, replay_setting
    from moesim.sim.whatif import CALIBRATION_SEED_OFFSET

    spec = get_model("qwen3-30b-a3b")
    params = SyntheticParams(tokens=4, prompt_len=16)
    calib = write_trace(synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=16,
                                                              draw_seed=params.seed + CALIBRATION_SEED_OFFSET)),
                        tmp_path / "calib.npz")
    (got,) = whatif(WhatifOptions(models=[spec.name], hws=["rtx4090"], policies=["hot-experts"], tokens=4, prompt_len=16,
                    jobs=1)).rows
    swept = synthetic_trace(spec, params)
    want = replay(swept, "rtx4090", ["hot-experts"], replay_setting(sim="simpy"), TraceChanges(placement_from=calib)).rows[0]
    assert 0 < got["resident_experts"] == want["resident_experts"] < spec.n_moe_layers * spec.n_experts
    assert got["tpot_ms"] == pytest.approx(want["tpot_ms"], rel=RTOL) and not got["optimistic_placement"]
    peek = replay(swept, "rtx4090", ["hot-experts"], replay_setting(sim="simpy", calibrate_on_replay=True)).rows[0]
    assert peek["tpot_ms"] != pytest.approx(got["tpot_ms"], rel=1e-3)
    share = got["resident_experts"] / (spec.n_moe_layers * spec.n_experts)
    assert got["device_hit_rate"] > share + 0.1


def test_family_axes_make_one_row_per_configuration():
    res = whatif(WhatifOptions(models=["olmoe-1b-7b"], hws=["a6000"], policies=["on-demand", "prefetch-fom", "cpu-static",
                                                                 "hot-experts", "cpu-on-miss", "all-resident"],
                 cache_gib=[0, 1], tokens=6, batch=[1, 4], prompt_len=[16], jobs=1, cpu_layers=["auto", 2],
                 gpu_expert_gib=["auto", 0.5], copy_queues=["fifo", "cancel-unstarted"], prefetch_top=[2, 8],
                 expert_dtypes=["bf16", "int8"]))
    rows = res.rows
    assert all(list(r) == list(ROW_COLUMNS) for r in rows)
    per_shape = {(r["batch"], r["expert_dtype"]) for r in rows}
    assert per_shape == {(1, "bf16"), (4, "bf16"), (1, "int8"), (4, "int8")}
    count = {}
    for r in rows:
        count[r["policy"]] = count.get(r["policy"], 0) + 1
    # per batch x dtype (4): on-demand 2 caches; prefetch-fom 2 caches x 2 queues x 2 top-M; cpu-static 2;
    # hot-experts 2 budgets; cpu-on-miss the one cache > 0; all-resident 1.
    assert count == {"on-demand": 8, "prefetch-fom": 32, "cpu-static": 8, "hot-experts": 8, "cpu-on-miss": 4,
                     "all-resident": 4}
    spec = get_model("olmoe-1b-7b")
    hot = [r for r in rows if r["policy"] == "hot-experts" and r["gpu_expert_gib"] == 0.5]
    for r in hot:  # the budget is honoured: at most 0.5 GiB of experts in the row's format
        assert r["resident_experts"] == int(0.5 * 2**30 // spec.with_expert_dtype(r["expert_dtype"]).expert_bytes)
    assert any("second synthetic trace" in n for n in res.notes) and any("synthetic traces" in n for n in res.notes)
    assert all(r["note"].startswith("placed from a second synthetic trace") for r in hot)


@pytest.mark.slow
@pytest.mark.parametrize("cli", BOTH_WAYS)
def test_the_link_crossover_follows_from_the_cost_model(tmp_path, cli):
    """Qwen3-30B-A3B on an A6000 (it does not fit whole: all-resident is out), cpu-static
    with every MoE layer on a desktop CPU against on-demand copying, along the link bandwidth. From the cost model alone (not the output's winner):
    - at 2 GB/s on-demand moves top_k x MoE layers experts per token (batch 1, no cache),
      so its TPOT is at least those bytes / 2 GB/s, more than cpu-static's whole TPOT;
    - at 10^5 GB/s on-demand's TPOT is at most its serial bound, the device's compute
      (slowed by the copy interference) plus every copy's latency + bytes / bandwidth plus a
      wake-up per MoE layer, less than the CPU's time to read the experts it computes
      (bytes / host memory bandwidth), a lower bound on cpu-static's TPOT.
    So the winner changes from cpu-static to prefetching between the two links."""
    spec, hw, host = get_model("qwen3-30b-a3b"), get_profile("a6000"), get_host("ryzen-7950x")
    lo, hi = 2.0, 1e5
    r = cli("whatif", "--model", spec.name, "--hw", hw.name, "--host", host.name, "--policy",
               "on-demand,cpu-static,all-resident", "--cpu-layers", spec.n_moe_layers, "--cache-gib", "0",
               "--link-gbps", f"{lo:g},{hi:g}", "--tokens", "4", "--jobs", "1", "--out", tmp_path / "r")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "r" / "whatif.json").read_text())
    rows = out["rows"]
    static = {x["link_gbps"]: x for x in rows if x["policy"] == "cpu-static"}
    resident = next(x for x in rows if x["policy"] == "all-resident")
    assert not resident["fits"]  # its compute is the device's work with every expert at hand
    copies = spec.top_k * spec.n_moe_layers * spec.expert_bytes  # bytes per token, batch 1, no cache
    assert copies / (lo * 1e9) * 1e3 > static[lo]["tpot_ms"]
    per_expert = hw.transfer_latency + spec.expert_bytes / (hi * 1e9)
    serial = ((1 + hw.interference) * resident["compute_ms"] / 1e3 + spec.top_k * spec.n_moe_layers * per_expert
              + spec.n_moe_layers * hw.get("wait_wakeup_us") * 1e-6)
    cpu_floor = copies / host.mem_bw
    assert serial < cpu_floor <= static[hi]["tpot_ms"] / 1e3
    # ... and the sweep finds exactly that change, on the link axis, and prints and reports it.
    link = [c for c in out["crossovers"] if c["axis"] == "link_gbps"]
    assert len(link) == 1 and link[0]["winners"] == ["cpu-static", "prefetching"]
    (change,) = link[0]["changes"]
    assert (change["from"], change["to"], change["after"], change["by"]) == ("cpu-static", "prefetching", lo, hi)
    assert lo < change["near"] < hi
    said = f"cpu-static wins at {number(lo)}, prefetching at {number(hi)}"  # as printed: 100,000
    assert said in " ".join(r.stdout.split())
    html = (tmp_path / "r" / "report.html").read_text()
    assert "Where the winner changes" in html and said in html
    assert (tmp_path / "r" / "crossovers.png").stat().st_size > 1000


def _row(fam, x, tpot, fits=True, **kw):
    return {"base_model": "m", "hw": "g", "host": "-" if fam in ("prefetching", "all-resident") else "h",
            "family": fam, "policy": fam, "batch": x, "prompt_len": 128, "link_gbps": 16.0, "tpot_ms": tpot,
            "ttft_ms": 1.0, "fits": fits, "bound": "link", "copy_ms": 1.0, "compute_ms": 1.0, "cpu_ms": None,
            "expert_dtype": "bf16", "cache_gib": 0.0, "copy_queue": "fifo", "prefetch_top": "-", "cpu_layers": 4, **kw}


def test_crossovers_on_constructed_rows():
    """cpu-static: 10 + x ms; prefetching: 40 - x ms (x = batch): they cross at x = 15,
    so the winner changes between batch 8 and 16 and the log-x interpolation lands there."""
    rows = [_row("cpu-static", x, 10 + x) for x in (1, 8, 16, 32)]
    rows += [_row("prefetching", x, 40 - x) for x in (1, 8, 16, 32)]
    rows += [_row("all-resident", x, 1.0, fits=False) for x in (1, 8, 16, 32)]  # never a winner
    (c,) = crossovers(rows)
    assert c.axis == "batch" and c.winners == ["cpu-static", "cpu-static", "prefetching", "prefetching"]
    (ch,) = c.changes
    assert (ch["from"], ch["to"], ch["after"], ch["by"]) == ("cpu-static", "prefetching", 8, 16)
    # cpu - pre: 18 - 32 = -14 at x=8, 26 - 24 = +2 at x=16: zero at 14/16 of the step in log x
    assert ch["near"] == pytest.approx(8 * 2 ** (14 / 16))
    (a,) = deployment_answer(rows)
    assert a.winner["family"] == "cpu-static" and a.batch == 1
    assert {f.family: f.status for f in a.families}["all-resident"] == "nothing fits"
    assert "nothing fits" in a.reason


def test_answer_table_fits_80_columns():
    res = whatif(WhatifOptions(models=["qwen3-30b-a3b"], hws=["a6000"], tokens=4, cache_gib=[0, 8], jobs=1,
                 expert_dtypes=["int4-g128"], copy_queues=["cancel-unstarted"], prefetch_top=[2]))
    (a,) = deployment_answer(res.rows)
    text = format_answer(a)
    assert max(len(line) for line in text.splitlines()) <= 80
    for fam in ("prefetching", "cpu-static", "hot-experts", "cpu-on-miss", "all-resident", "oracle (bound)"):
        assert fam in text
    assert a.winner is not None and a.winner["fits"] and a.winner["family"] != "oracle (bound)"
    assert {f.family: f.row["fits"] for f in a.families if f.row} == {f.family: True for f in a.families if f.row}


@pytest.mark.parametrize("args, says", [
    (["--batch", "1,x"], "--batch"),
    (["--cpu-layers", "99"], "--cpu-layers 99"),
    (["--copy-queue", "lifo"], "unknown copy queue"),
])
@pytest.mark.parametrize("cli", BOTH_WAYS)
def test_bad_axes_are_one_line_exit_2(args, says, tmp_path, cli):
    r = cli("whatif", "--model", "tiny", "--hw", "a6000", "--tokens", "4", "--jobs", "1", "--out", tmp_path / "r",
               *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert not (tmp_path / "r").exists()  # refused before any work


@pytest.mark.parametrize("kw, says", [
    ({"batch": [0]}, "--batch 0"),
    ({"prompt_len": [128, 128]}, "appears twice"),
    ({"cpu_layers": ["auto", -1]}, "--cpu-layers"),
    ({"gpu_expert_gib": ["much"]}, "--gpu-expert-gib"),
    ({"prefetch_top": [0]}, "--prefetch-top"),
    ({"prefetch_top": [99]}, "--prefetch-top 99"),
    ({"expert_dtypes": ["int3"]}, "unknown expert dtype"),
    ({"hosts": ["pentium"]}, "unknown host profile"),
    ({"policies": ["cpu-static", "sometimes"]}, "sometimes"),
])
def test_bad_axes_are_refused_before_any_work(kw, says, monkeypatch):
    from moesim.sim import sweep as sweep_module

    monkeypatch.setattr(sweep_module, "run_group", lambda *a: pytest.fail("a group ran"))
    with pytest.raises(MoesimError, match=says.replace("-", r"\-")):
        whatif(WhatifOptions(**{"models": ["tiny"], "hws": ["a6000"], "tokens": 4, "jobs": 1, **kw}))


@pytest.mark.parametrize("cli", BOTH_WAYS)
def test_recorded_trace_axes_and_calibration_are_checked(traces, tmp_path, cli):
    run, calib = traces
    r = cli("whatif", "--trace", run, "--hw", "a6000", "--policy", "hot-experts", "--out", tmp_path / "r")
    assert r.returncode == 2 and r.stderr.startswith("error: hot-experts places experts") and len(
        r.stderr.strip().splitlines()) == 1
    # Among the default policies it is left out with a note, not the whole sweep refused (it was).
    res = whatif(WhatifOptions(run, hws=["a6000"], cache_gib=[0], jobs=1))
    assert res.rows and "hot-experts" not in {r["policy"] for r in res.rows} and "cpu-static" in {
        r["policy"] for r in res.rows}
    assert any(n.startswith("hot-experts places experts") and n.endswith("to sweep it: left out") for n in res.notes)
    # and an option only hot-experts reads is then noted as changing nothing (it was silent)
    res = whatif(WhatifOptions(run, hws=["a6000"], cache_gib=[0], jobs=1, gpu_expert_gib=[1.0]))
    assert any(n.startswith("--gpu-expert-gib was given") and n.endswith("it changed nothing") for n in res.notes)
    with pytest.raises(MoesimError, match="recorded trace"):
        whatif(WhatifOptions(run, hws=["a6000"], batch=[1, 4]))
    with pytest.raises(MoesimError, match="not both"):
        whatif(WhatifOptions(run, hws=["a6000"], placement_from=calib, calibrate_on_replay=True))
    res = whatif(WhatifOptions(run, hws=["a6000"], policies=["hot-experts"], cache_gib=[0], calibrate_on_replay=True, jobs=1))
    assert all(r["optimistic_placement"] and r["note"].startswith("optimistic") for r in res.rows)
    assert any(n.startswith("optimistic") for n in res.notes)


def test_rows_resume_with_cpu_policies(tmp_path):
    spec = get_model("olmoe-1b-7b")
    tr = synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=16, seed=2))
    calib = synthetic_trace(spec, SyntheticParams(tokens=6, prompt_len=16, seed=3)).true_ids
    sweep = Sweep({spec.name: tr}, [get_profile("a6000"), get_profile("gh200")],
                  ["on-demand", "cpu-static", "hot-experts", "cpu-on-miss"], [None, 8.0], [0.0, 1.0],
                  cpu_layers=("auto", 3), gpu_expert_gib=("auto", 0.25), calibration={spec.name: calib},
                  calibration_source="a test calibration trace")
    whole = run_sweep(sweep, jobs=1)
    out = tmp_path / "rows.csv"
    calls = []

    def stop_after_three(done, total):
        calls.append(done)
        if len(calls) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, jobs=1, progress=stop_after_three, out=out)
    kept = len(out.read_text().splitlines()) - 1
    assert kept == 3 * sweep.group_size
    assert run_sweep(sweep, jobs=1, out=out) == whole  # resumed: CPU columns (words, None) read back exactly


@pytest.mark.parametrize("cli", BOTH_WAYS)
def test_models_expert_dtype(tmp_path, cli):
    r = cli("models", "qwen3-30b-a3b", "--expert-dtype", "int4-g128", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["models"]
    want = get_model("qwen3-30b-a3b").with_expert_dtype("int4-g128")
    assert row["expert_dtype"] == "int4-g128" and row["expert_bytes"] == want.expert_bytes
    assert row["expert_bytes"] < get_model("qwen3-30b-a3b").expert_bytes / 3  # ~4.1 bits against 16
    with pytest.raises(MoesimError, match="unknown expert dtype 'int3'"):  # what the CLI prints, exit 2
        get_model("qwen3-30b-a3b").with_expert_dtype("int3")


@pytest.mark.slow
def test_ray_backend_gives_the_local_rows_for_cpu_policies():
    pytest.importorskip("ray")
    spec = get_model("tiny")
    tr = synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=8, seed=2))
    calib = synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=8, seed=3)).true_ids
    sweep = Sweep({spec.name: tr}, [get_profile("a6000")], ["prefetch-fom", "cpu-static", "hot-experts", "cpu-on-miss"],
                  [None], [0.0, 0.001], cpu_layers=("auto", 1), copy_queues=("fifo", "demand-first"),
                  calibration={spec.name: calib}, calibration_source="a test calibration trace")
    assert run_sweep(sweep, backend="ray") == run_sweep(sweep, jobs=1)
