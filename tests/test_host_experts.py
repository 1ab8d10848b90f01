"""The executor's CPU experts: a thread pool computing host-held experts beside the
device, and weight-only int8 / int4 experts whose stored bytes are the byte accounting's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from moesim.executor.host_experts import HostExperts
from moesim.executor.model import expert_forward
from moesim.executor.quant_experts import QuantExpert, quantize
from moesim.models import get_model, matrix_bytes

H, INTER, E = 64, 32, 8


def _experts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(3 * H * INTER, generator=g) * 0.1 for _ in range(E)] for _ in range(2)]


def _reference(weights, x, ids, gates, only):
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for c, e in enumerate(ids[r].tolist()):
            if e in only:
                out[r] += gates[r, c] * expert_forward(weights[e], x[r:r + 1], H, INTER)[0]
    return out


def test_host_experts_equal_the_device_formula_for_their_share():
    weights = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, H, generator=g)
    ids = np.array([[0, 3], [3, 5], [1, 0], [7, 3], [5, 6]])
    gates = torch.rand(5, 2, generator=g)
    cpu_share = [3, 5, 7]
    with HostExperts(H, INTER, weights=weights, workers=3) as host:
        job = host.submit(1, x, ids, gates, cpu_share)
        y = job.result()
    torch.testing.assert_close(y, _reference(weights[1], x, ids, gates, set(cpu_share)), rtol=1e-5, atol=1e-6)
    # The device's share plus the CPU's share is the whole layer.
    device = _reference(weights[1], x, ids, gates, {0, 1, 6})
    torch.testing.assert_close(y + device, _reference(weights[1], x, ids, gates, set(range(E))), rtol=1e-5, atol=1e-6)


def test_host_experts_run_while_the_caller_continues():
    started, release = threading.Event(), threading.Event()

    def slow(layer, expert, x):
        started.set()
        assert release.wait(10)
        return torch.ones(x.shape[0], H)

    with HostExperts(H, INTER, expert_fn=slow, workers=1) as host:
        job = host.submit(0, torch.zeros(1, H), np.array([[2, 4]]), torch.ones(1, 2), [2])
        assert started.wait(10)
        assert not job.done()  # submit returned while the expert is still running
        release.set()
        assert torch.equal(job.result(), torch.ones(1, H))


def test_an_expert_routed_nowhere_costs_nothing():
    with HostExperts(H, INTER, weights=_experts(), workers=1) as host:
        job = host.submit(0, torch.randn(2, H), np.array([[0, 1], [1, 0]]), torch.ones(2, 2), [4])
        assert job.futures == {} and torch.equal(job.result(), torch.zeros(2, H))


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g128"])
def test_stored_bytes_are_the_byte_accounting(fmt):
    for rows, cols in ((32, 64), (7, 129), (64, 32)):
        w = torch.randn(rows, cols)
        assert quantize(w, fmt).nbytes == matrix_bytes(rows, cols, fmt), (rows, cols)
    spec = get_model("tiny").with_expert_dtype(fmt)
    q = QuantExpert.from_flat(torch.randn(3 * spec.hidden * spec.expert_inter), spec.hidden, spec.expert_inter, fmt)
    assert q.nbytes == spec.expert_bytes


@pytest.mark.parametrize("fmt, tol", [("int8", 0.02), ("int4-g32", 0.2), ("int4-g128", 0.25)])
def test_quantised_experts_stay_close_to_bf16(fmt, tol):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3 * H * INTER, generator=g) * 0.1
    x = torch.randn(4, H, generator=g)
    ref = expert_forward(w, x, H, INTER)
    y = QuantExpert.from_flat(w, H, INTER, fmt).forward(x)
    err = (y - ref).norm() / ref.norm()
    assert err < tol, float(err)
    coarser = {"int8": None, "int4-g32": "int8", "int4-g128": "int4-g32"}[fmt]
    if coarser:  # fewer bits or bigger groups lose more
        finer = (QuantExpert.from_flat(w, H, INTER, coarser).forward(x) - ref).norm() / ref.norm()
        assert finer < err


def test_int4_round_trip_is_exact_on_representable_weights():
    # Weights on each group's 16-level grid come back exactly (fp16 scale and zero).
    levels = torch.arange(16, dtype=torch.float32) * 0.25 - 1.0
    w = levels[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(3))]
    w[:, ::32] = -1.0
    w[:, 1::32] = 2.75  # every group spans the full range
    torch.testing.assert_close(quantize(w, "int4-g32").dequantize(), w)


def test_quantised_experts_run_on_the_host_pool():
    w = torch.randn(3 * H * INTER) * 0.1
    q = QuantExpert.from_flat(w, H, INTER, "int8")
    x = torch.randn(3, H)
    ids, gates = np.array([[0], [0], [1]]), torch.ones(3, 1)
    with HostExperts(H, INTER, expert_fn=lambda layer, e, rows: q.forward(rows), workers=2) as host:
        y = host.submit(0, x, ids, gates, [0]).result()
    torch.testing.assert_close(y[:2], q.forward(x[:2]), rtol=1e-5, atol=1e-6)
    assert torch.equal(y[2], torch.zeros(H))


@pytest.mark.parametrize("policy", ["cpu-static", "cpu-on-miss"])
def test_the_decoders_host_layer_gives_the_all_resident_logits(policy):
    """The one place a layer is split between the device and the CPU (the production
    decoder's ``_host_layer``: the device's share from its slots, the CPU's on the host
    pool, summed) gives the all-resident logits, for a prefill and decode steps, with the
    CPU really running experts (cpu-on-miss: misses both copied into the cache and run on
    the CPU)."""
    from moesim.costmodel import ExpertTimes
    from moesim.executor.model import ExecConfig, random_model
    from moesim.executor.runtime import HostSetup, Offload, OffloadedDecoder, host_setup
    from moesim.executor.transport import EmulatedLink
    from moesim.hardware import get_profile
    from moesim.setting import Setting

    spec = get_model("tiny")
    model = random_model(ExecConfig(spec), seed=3)
    tokens = torch.randint(0, spec.vocab, (2, 6), generator=torch.Generator().manual_seed(4))
    if policy == "cpu-static":  # layers 0-1 on the CPU, 2-3 resident
        setup, cache = host_setup(spec, policy, get_profile("a6000"), Setting(cpu_layers=2)), 0
    else:  # decision figures under which two misses split: one copied, one on the CPU
        times = ExpertTimes(gpu_mem=0.0, gpu_tok=0.0, gpu_fixed=0.0, cpu_mem=1.5e-6, cpu_tok=0.0, cpu_fixed=0.0,
                            roundtrip=0.0, copy=1e-6)
        setup, cache = HostSetup(None, times, "test figures", 0.0), 4

    def run(name, cache, **kw):
        dec = OffloadedDecoder(model, name, EmulatedLink(1e9, 0), Offload(cache), **kw)
        kv = model.new_cache(2, 8)
        recs = [dec.step(tokens[:, :3], kv, 0, prefill=True)]
        recs += [dec.step(tokens[:, i:i + 1], kv, i, step_index=i - 3) for i in range(3, 6)]
        dec.close()
        return dec, recs

    _, want = run("all-resident", 0)
    dec, got = run(policy, cache, host_setup=setup)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
    assert sum(int(r.cpu_experts.sum()) for r in got) > 0
    if policy == "cpu-static":
        assert all((r.cpu_experts[2:] == 0).all() for r in got)
    else:  # the copied misses entered the device cache
        copied = [(spec.moe_layers.index(c.layer), c.expert) for r in got for c in r.copies]
        assert copied and any(key in dec.host_planner.cache for key in copied)


@pytest.mark.parametrize("rows", [1, 5])
def test_one_mix_serves_dense_quantised_and_split_layers(rows):
    """``mix_experts`` is the one gated sum: a subset and its complement add up to the whole
    layer, and quantised experts go through the same function with their own forward."""
    from moesim.executor.model import mix_experts

    weights = _experts()[0]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, H, generator=g)
    ids = np.array([[0, 3], [3, 5], [1, 0], [7, 3], [5, 6]])[:rows]
    gates = torch.rand(rows, 2, generator=g)

    def dense(w, xs):
        return expert_forward(w, xs, H, INTER)

    whole = mix_experts(x, ids, gates, weights, dense)
    torch.testing.assert_close(whole, _reference(weights, x, ids, gates, set(range(E))), rtol=1e-5, atol=1e-6)
    part = mix_experts(x, ids, gates, weights, dense, only={0, 5}) + mix_experts(x, ids, gates, weights, dense,
                                                                                only={1, 3, 6, 7})
    torch.testing.assert_close(part, whole, rtol=1e-5, atol=1e-6)
    quant = [QuantExpert.from_flat(w, H, INTER, "int8") for w in weights]
    got = mix_experts(x, ids, gates, quant, lambda q, xs: q.forward(xs))
    want = sum(gates[:, c, None] * torch.stack([quant[e].forward(x[r:r + 1])[0] for r, e in enumerate(ids[:, c])])
               for c in range(2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
