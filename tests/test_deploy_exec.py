"""The executor running the CPU-compute policies (cpu-static, hot-experts, cpu-on-miss) and
quantised experts: exact tokens, the CPU's share really on the host pool, the trace it
writes, and the command line end to end (issue 13)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_run import runners

from moesim.costmodel import ExpertTimes
from moesim.executor.model import ExecConfig, expert_forward, random_model
from moesim.executor.profile import Origin, ProfileSettings, build_trace, generate
from moesim.executor.quant_experts import QuantExpert
from moesim.executor.runtime import HostSetup, host_setup
from moesim.hardware import DEFAULT_PROFILE, get_profile
from moesim.models import get_model
from moesim.setting import Setting
from moesim.traces.format import read_trace, write_trace

SPEC = get_model("tiny")
HW = get_profile(DEFAULT_PROFILE).with_figure("h2d_pinned_gbs", 50.0)
TOKENS = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_model(ExecConfig(SPEC), seed=3)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, SPEC.vocab, (1, 6), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def reference(model, prompt):
    _, recs, toks = generate(model, prompt, ProfileSettings("all-resident", tokens=TOKENS), HW)
    return torch.cat(toks, 1), recs


def _calibration(seed=1):
    return np.random.default_rng(seed).integers(0, SPEC.n_experts, (16, SPEC.n_moe_layers, 1, SPEC.top_k))


def _miss_times() -> ExpertTimes:
    """Decision figures (1 us a copy, 1.5 us a CPU expert, a free device) under which a
    layer with two misses copies one and runs the other on the CPU, and a single miss is
    copied: a copy's 1 us of queue has drained long before the next layer's decision on any
    machine, so both paths are taken whatever the machine's speed."""
    return ExpertTimes(gpu_mem=0.0, gpu_tok=0.0, gpu_fixed=0.0, cpu_mem=1.5e-6, cpu_tok=0.0, cpu_fixed=0.0,
                       roundtrip=0.0, copy=1e-6)


def _setup(policy: str) -> tuple[HostSetup, int]:
    if policy == "cpu-static":
        return host_setup(SPEC, policy, HW, Setting(cpu_layers=2)), 0
    if policy == "hot-experts":
        return host_setup(SPEC, policy, HW, Setting(calibration=_calibration()), gpu_experts=20), 0
    return HostSetup(None, _miss_times(), "test figures", 0.0), 6


@pytest.mark.parametrize("policy", ["cpu-static", "hot-experts", "cpu-on-miss"])
def test_cpu_compute_policies_decode_the_all_resident_tokens(model, prompt, reference, policy):
    setup, cache = _setup(policy)
    st = ProfileSettings(policy, cache_experts=cache, tokens=TOKENS, host_setup=setup)
    _, recs, toks = generate(model, prompt, st, HW)
    assert torch.equal(torch.cat(toks, 1), reference[0])  # greedy: exactly the same tokens
    cpu = np.stack([r.cpu_experts for r in recs])  # [T, M]
    assert cpu.sum() > 0  # the CPU really ran experts ...
    cpu_s = np.stack([r.cpu_s for r in recs])  # ... and was timed: past attn_s where it ran, never where it did not
    assert (cpu_s[cpu > 0] > 0).any() and (cpu_s[cpu == 0] == 0).all()
    if policy == "cpu-static":  # the first two MoE layers on the CPU, the rest never
        assert (cpu[:, :2] > 0).all() and (cpu[:, 2:] == 0).all()
    if policy == "hot-experts":  # the CPU ran exactly the routed experts outside the hot set
        resident = setup.placement.resident
        want = [[len({int(e) for e in r.true_ids[m].reshape(-1)} - set(np.flatnonzero(resident[m])))
                 for m in range(SPEC.n_moe_layers)] for r in recs]
        assert np.array_equal(cpu, np.array(want))
    if policy == "cpu-on-miss":  # cpu_or_copy sent some misses over the link, some to the CPU
        assert sum(len(r.copies) for r in recs) > 0
        assert all(c.kind == 1 and c.nbytes == SPEC.expert_weights * 4 for r in recs for c in r.copies)


def test_a_cpu_compute_trace_records_its_setup_and_replays(model, prompt, tmp_path):
    from moesim.sim.validate import validate_trace

    setup, _ = _setup("cpu-static")
    st = ProfileSettings("cpu-static", tokens=TOKENS, host_setup=setup,
                         host_params={"host_profile": setup.host, "cpu_layers": setup.cpu_layers,
                                        "device_memory_gb": setup.device_memory_gb})
    pre, recs, toks = generate(model, prompt, st, HW)
    path = write_trace(build_trace(model, prompt, st, HW, pre, recs, toks, Origin("cpu", True, "test")), tmp_path / "t.npz")
    tr = read_trace(path)
    assert tr.meta.policy == "cpu-static" and tr.meta.cpu_layers == 2 and tr.meta.host_profile == setup.host
    assert tr.timings["cpu_s"].shape == tr.timings["cpu_wait_s"].shape == (TOKENS, SPEC.n_moe_layers)
    assert (tr.timings["cpu_experts"][:, :2] > 0).all()
    assert tr.head(3).timings["cpu_experts"].shape == (3, SPEC.n_moe_layers)
    stats, result = validate_trace(tr)
    assert stats["policy"] == "cpu-static" and stats["tokens"] == TOKENS - 1
    assert result.config["timing"].startswith("measured")
    assert np.array_equal(result.run.n_cpu, tr.timings["cpu_experts"])  # the replay split the layers alike


@pytest.mark.parametrize("fmt", ["int8", "int4-g128"])
def test_quantised_experts_copy_their_accounted_bytes_and_match_the_dequantised_model(model, prompt, fmt):
    st = ProfileSettings("on-demand", tokens=TOKENS, expert_dtype=fmt)
    _, recs, toks = generate(model, prompt, st, HW)
    copies = [c for r in recs for c in r.copies]
    assert copies and {c.nbytes for c in copies} == {SPEC.with_expert_dtype(fmt).expert_bytes}
    # Reference: the same model with every expert replaced by its dequantised weights, all resident.
    deq = random_model(ExecConfig(SPEC), seed=3)
    deq.experts = [[_dequantised(w, fmt) for w in row] for row in model.experts]
    forced = torch.cat(toks, 1)
    _, ref, _ = generate(deq, prompt, ProfileSettings("all-resident", tokens=TOKENS), HW, forced=forced)
    _, got, _ = generate(model, prompt, st, HW, forced=forced)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    # The host pool runs the same quantised experts (cpu-static, every layer on the CPU).
    setup = host_setup(SPEC, "cpu-static", HW, Setting(cpu_layers=SPEC.n_moe_layers))
    _, cpu, _ = generate(model, prompt, ProfileSettings("cpu-static", tokens=TOKENS, expert_dtype=fmt, host_setup=setup),
                         HW, forced=forced)
    for a, b in zip(cpu, ref, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)


def _dequantised(w: torch.Tensor, fmt: str) -> torch.Tensor:
    q = QuantExpert.from_flat(w, SPEC.hidden, SPEC.expert_inter, fmt)
    flat = torch.cat([q.gate.dequantize().reshape(-1), q.up.dequantize().reshape(-1), q.down.dequantize().reshape(-1)])
    x = torch.randn(2, SPEC.hidden)
    torch.testing.assert_close(expert_forward(flat, x, SPEC.hidden, SPEC.expert_inter), q.forward(x))
    return flat.to(w.dtype)


def moesim(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moesim", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


#: ``run``: in-process by default, this module's subprocess with -m slow (see cli_run.runners)
BOTH_WAYS = runners(moesim)


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_profile_cpu_static_writes_a_trace_that_replay_validates(tmp_path, run):
    trace = tmp_path / "cpu.npz"
    r = run("profile", "--model", "tiny", "--policy", "cpu-static", "--cpu-layers", 3, "--tokens", 4,
               "--expert-dtype", "int8", "--out", trace)
    assert r.returncode == 0, r.stderr
    tr = read_trace(trace)
    assert tr.meta.policy == "cpu-static" and tr.meta.cpu_layers == 3 and tr.meta.expert_dtype == "int8"
    assert tr.model.expert_dtype == "int8" and (tr.timings["cpu_experts"][:, 3:] == 0).all()
    v = run("replay", trace, "--validate", "--json")
    assert v.returncode == 0, v.stderr
    row = json.loads(v.stdout)
    row = row[0] if isinstance(row, list) else row
    assert row["policy"] == "cpu-static" and row["recorded_policy"] == "cpu-static"


@pytest.mark.parametrize(("kw", "text"), [
    ({"policy": "hot-experts"}, "needs a calibration trace"),
    ({"policy": "on-demand", "cpu_layers": "2"}, "apply to the CPU-compute policies"),
    ({"policy": "cpu-static", "cpu_layers": "9"}, "--cpu-layers must be"),
    ({"policy": "cpu-static", "gpu_experts": 3}, "does not apply to cpu-static"),
    ({"policy": "cpu-on-miss"}, "needs a device expert cache"),
    ({"policy": "hot-experts", "placement_from": "nowhere.npz"}, "does not exist"),
])
def test_bad_cpu_policy_options_fail_before_any_work(tmp_path, monkeypatch, kw, text):
    from moesim.errors import MoesimError
    from moesim.executor import runs

    def no_model(*a, **k):
        raise AssertionError("loaded the model before checking the options")

    monkeypatch.setattr(runs, "load_model", no_model)
    with pytest.raises(MoesimError) as e:
        runs.record_decode(runs.DecodeRequest(model="tiny", tokens=2, **kw), tmp_path / "x.npz")
    assert text in str(e.value) and not (tmp_path / "x.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_a_bad_expert_dtype_is_one_line_on_the_command_line(tmp_path, run):
    r = run("profile", "--model", "tiny", "--tokens", 2, "--expert-dtype", "int3", "--out", tmp_path / "x.npz")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--expert-dtype 'int3'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x.npz").exists()


def test_packed_quantised_experts_read_back_from_any_slot():
    """An expert of odd packed size read through views of a slot: the fp16 scales need an
    even byte offset, so slots are 16-byte aligned (the runtime's pool) and the buffer
    itself holds exactly the accounted bytes."""
    from moesim.executor.runtime import _ExpertStore

    w = torch.randn(3 * 7 * 5)
    q = QuantExpert.from_flat(w, 7, 5, "int8")
    assert q.nbytes % 2 == 1 and q.pack().numel() == q.nbytes
    x = torch.randn(2, 7)
    width = -(-q.nbytes // 16) * 16
    pool = torch.zeros(3, width, dtype=torch.uint8)
    for slot in range(3):
        pool[slot, :q.nbytes].copy_(q.pack())
        assert torch.equal(q.view(pool[slot]).forward(x), q.forward(x))
    store = _ExpertStore(random_model(ExecConfig(SPEC), seed=1), "int4-g32", torch.device("cpu"))
    assert store.width % 16 == 0 and store.width >= store.src[0][0].numel()


def test_measured_replay_of_a_static_placement_is_the_step_model_on_the_recorded_times():
    """cpu-static replayed with measured timing: each layer is attn + max(device experts x
    recorded seconds each, CPU experts x recorded seconds each), the split the placement's
    (synthetic routing, hand-made times)."""
    from moesim.sim.cpu_compute import simulate_cpu_compute
    from moesim.traces.synthetic import SyntheticParams, synthetic_trace

    tr = synthetic_trace(SPEC, SyntheticParams(tokens=5, prompt_len=4, seed=2))
    t, m = tr.n_tokens, SPEC.n_moe_layers
    distinct = np.array([[len(set(tr.true_ids[s, j].reshape(-1).tolist())) for j in range(m)] for s in range(t)])
    cpu = np.zeros((t, m), np.int16)
    cpu[:, :2] = distinct[:, :2]  # cpu-static, 2 layers: every routed expert of layers 0-1 on the CPU
    dev = distinct - cpu
    attn = np.full((t, SPEC.n_layers), 1e-3)
    tr.timings.update(attn_s=attn, expert_s=dev * 2e-3, stall_s=np.zeros((t, m)), other_s=np.full(t, 5e-4),
                      predict_s=np.zeros((t, SPEC.n_layers)), cpu_s=cpu * 3e-3, cpu_wait_s=np.zeros((t, m)),
                      cpu_experts=cpu, tpot_s=np.ones(t))
    r = simulate_cpu_compute(tr, HW, "cpu-static", Setting(cpu_layers=2, timing="measured"))
    want = attn.sum(1) + np.maximum(dev * 2e-3, cpu * 3e-3).sum(1) + 5e-4
    np.testing.assert_allclose(r.tpot, want, rtol=1e-9)
    assert np.array_equal(r.run.n_cpu, cpu)
    # Without CPU times (a copy policy's trace) the CPU's share falls back to the roofline.
    del tr.timings["cpu_s"], tr.timings["cpu_experts"], tr.timings["cpu_wait_s"]
    fallback = simulate_cpu_compute(tr, HW, "cpu-static", Setting(cpu_layers=2, timing="measured", host="epyc-7742"))
    assert np.isfinite(fallback.tpot).all() and not np.allclose(fallback.tpot, want)
