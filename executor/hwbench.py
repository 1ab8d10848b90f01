"""Measure this machine and write a hardware profile (``moesim profile --hardware``).

CUDA: host-to-device bandwidth from pinned and pageable memory and the per-transfer
latency (a line fitted over transfer sizes), device-memory bandwidth, bf16 GEMM and
GEMV rates, kernel-launch overhead, and NVML facts. CPU: matmul and memory figures, the
per-op dispatch overhead, and what the emulated link can do (its fastest copy rate and
the thread hand-off latency). Every figure is marked measured, with when and on what.

On a CPU it also measures the machine as a *host* (:func:`measure_host`): the figures
the CPU-compute policies and an all-CPU deployment (``--hw none``) are priced with
(memory bandwidth with every core and with one, bf16 and int8 rates, RAM), written
beside the device profile as ``NAME-host.toml`` for ``--host``.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from moesim.atomic import atomic_write_text
from moesim.executor.host_experts import HostExperts
from moesim.executor.profile import check_device
from moesim.executor.transport import EmulatedLink, Transfer
from moesim.hardware import FIGURES, HOST_FIGURES, Figure, HardwareProfile, HostProfile, get_host, get_profile
from moesim.outputs import check_output_file
from moesim.timing import best_time

Step = Callable[[str], None]
#: How many times :func:`measure` calls ``step`` on each kind of device (for a progress bar's
#: time left; tests/test_hardware.py counts the CPU ones).
MEASURE_STEPS = {"cpu": 6, "cuda": 6}


def _tiny_ops(t: torch.Tensor, reps: int) -> Callable[[], None]:
    """``reps`` one-element adds: what one op costs to dispatch (CPU) or launch (CUDA)."""

    def run() -> None:
        for _ in range(reps):
            t.add_(1)

    return run


def _fit_line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """time = latency + bytes / bandwidth, least squares; returns (bandwidth B/s, latency s)."""
    slope, intercept = np.polyfit(np.array(sizes, float), np.array(seconds, float), 1)
    return 1.0 / slope, max(float(intercept), 1e-7)


def cpu_wakeup() -> float:
    """Seconds from an emulated copy's (ideal) end to the waiting thread running again:
    the median over paced 200 us transfers."""
    link = EmulatedLink(1e9, 0.0)
    src, dst = torch.zeros(50_000), torch.empty(50_000)  # 200 KB: 200 us at 1 GB/s
    lags = []
    for _ in range(40):
        t = Transfer(0, 0, src.numel() * 4, 1)
        link.copy_batch([(dst, src, t, None)])
        link.wait([t])
        lags.append(time.perf_counter() - t.end)
    link.close()
    return max(0.0, float(np.median(lags)))


def cpu_interference(copy_gbs: float, repeats: int = 5) -> float:
    """How much slower memory-bound compute (fp32 GEMVs over a 16 MiB matrix, one thread)
    runs while the emulated link copies back to back at its full memcpy rate ``copy_gbs``:
    median over ``repeats`` of t_with / t_alone - 1. On a CPU both stream DRAM."""
    w, x = torch.randn(2048, 2048), torch.randn(2048)
    acc = torch.zeros(2048)

    def work():
        for _ in range(40):
            acc.add_(w @ x)

    link = EmulatedLink(1e15, 0.0)  # unpaced: the memcpy runs as fast as it can
    src = torch.zeros(2**18)  # 1 MiB
    dsts = [torch.empty_like(src) for _ in range(4)]
    ratios = []
    for _ in range(repeats):
        alone = best_time(work, 2)
        n_batches = int(alone * 3 * copy_gbs * 1e9 / (4 * 2**20)) + 8  # keep the link busy past the work
        last = []
        for _ in range(n_batches):
            last = link.copy_batch([(d, src, Transfer(0, 0, 2**20, 0), None) for d in dsts])
        t0 = time.perf_counter()
        work()
        ratios.append((time.perf_counter() - t0) / alone - 1)
        link.wait(last)
    link.close()
    return max(0.0, float(np.median(ratios)))


def measure_cpu(step: Step) -> tuple[dict[str, tuple[float, str]], dict[str, str]]:
    figs: dict[str, tuple[float, str]] = {}
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    step("fp32 / bf16 matmul")
    figs["bf16_tflops"] = (2 * n**3 / best_time(lambda: a.bfloat16() @ b.bfloat16()) / 1e12, "bf16 GEMM 1024^3 (incl. casts)")
    fp32 = 2 * n**3 / best_time(lambda: a @ b) / 1e12
    step("memory bandwidth")
    big = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(big)
    copy_bw = 2 * big.numel() * 4 / best_time(lambda: dst.copy_(big))
    w, x = torch.randn(4096, 4096), torch.randn(4096)
    gemv_bw = w.numel() * 4 / best_time(lambda: w @ x)
    figs["mem_bw_peak_gbs"] = (max(copy_bw, gemv_bw) / 1e9, "highest of a 64 MiB copy (read+write) and an fp32 GEMV")
    figs["mem_bw_achievable_gbs"] = (gemv_bw / 1e9, "fp32 GEMV 4096x4096: weight bytes / time")
    figs["host_mem_bw_gbs"] = (copy_bw / 1e9, "64 MiB tensor copy, read + write bytes / time")
    step("per-op overhead")
    reps = 2000
    figs["kernel_launch_us"] = (best_time(_tiny_ops(torch.zeros(1), reps)) / reps * 1e6,
                                "one tiny torch op (dispatch overhead)")
    step("emulated link")
    link = EmulatedLink(1e15, 0.0)  # unpaced: measures the thread hand-off and the real copy rate
    src, sink = torch.zeros(256), torch.empty(256)
    lat = []
    for _ in range(50):
        t = Transfer(0, 0, 1024, 1)
        t0 = time.perf_counter()
        link.copy_batch([(sink, src, t, None)])
        link.wait([t])
        lat.append(time.perf_counter() - t0)
    link.close()
    figs["transfer_latency_us"] = (float(np.median(lat)) * 1e6, "emulated link: median hand-off of a 1 KiB copy")
    figs["h2d_pinned_gbs"] = (copy_bw / 2 / 1e9, "fastest the emulated link can copy (memcpy rate, one thread)")
    step("copy/compute interference")
    figs["copy_interference"] = (cpu_interference(copy_bw / 2 / 1e9), "slowdown of fp32 GEMVs over 16 MiB while the "
                                 "emulated link copies back to back (median t_with / t_alone - 1)")
    figs["copy_interference_gbs"] = (copy_bw / 2 / 1e9, "the memcpy rate the interference was measured at")
    figs["wait_wakeup_us"] = (cpu_wakeup() * 1e6, "emulated link: median delay from a copy's end to the waiter running")
    figs["h2d_pageable_gbs"] = figs["h2d_pinned_gbs"]
    figs["device_memory_gb"] = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, "physical memory")
    figs["copy_engines"] = (1, "the emulated link is one thread")
    figs["compute_efficiency"] = (1.0, "rates above are measured, already achievable")
    facts = {"cpu": platform.processor() or platform.machine(), "cores": str(os.cpu_count()),
             "torch_threads": str(torch.get_num_threads()), "fp32_tflops": f"{fp32:.4f}"}
    return figs, facts


def measure_cuda(device: torch.device, step: Step) -> tuple[dict[str, tuple[float, str]], dict[str, str]]:
    figs: dict[str, tuple[float, str]] = {}
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream(priority=-1)

    def timed(fn: Callable[[], None], repeat: int = 5, on: torch.cuda.Stream | None = None) -> float:
        s = on or torch.cuda.current_stream()
        fn()
        best = float("inf")
        for _ in range(repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            with torch.cuda.stream(s):
                fn()
            b.record(s)
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        return best

    sizes = [2**16, 2**20, 2**24, 2**28]
    for kind, pinned in (("pinned", True), ("pageable", False)):
        step(f"host-to-device, {kind}")
        secs = []
        for n in sizes:
            src = torch.empty(n, dtype=torch.uint8)
            src = src.pin_memory() if pinned else src
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            secs.append(timed(lambda d=dst, s_=src, p=pinned: d.copy_(s_, non_blocking=p), on=stream))
        bw, lat = _fit_line(sizes, secs)
        figs[f"h2d_{kind}_gbs"] = (sizes[-1] / secs[-1] / 1e9, f"copy-stream H2D of 256 MiB ({kind}); fitted line {bw / 1e9:.1f} GB/s")
        if pinned:
            figs["transfer_latency_us"] = (lat * 1e6, "intercept of time = latency + bytes/bw over 64 KiB-256 MiB, pinned")
    step("device memory bandwidth")
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    dbw = 2 * a.numel() / timed(lambda: b.copy_(a))
    figs["mem_bw_achievable_gbs"] = (dbw / 1e9, "1 GiB device-to-device copy, read + write bytes / time")
    step("bf16 GEMM and GEMV")
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    figs["bf16_tflops"] = (2 * 8192**3 / timed(lambda: m @ m) / 1e12, "bf16 GEMM 8192^3")
    v = torch.randn(8192, device=device, dtype=torch.bfloat16)
    gemv = m.numel() * 2 / timed(lambda: m @ v)
    step("kernel launch")
    reps = 1000
    figs["kernel_launch_us"] = (timed(_tiny_ops(torch.zeros(1, device=device), reps)) / reps * 1e6,
                                "1000 tiny kernels back to back, per kernel")
    step("copy/compute interference")
    host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(2**30, dtype=torch.uint8, device=device)
    alone = timed(lambda: [m @ v for _ in range(20)])
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)  # ~20 ms of DMA on PCIe 5 while the GEMVs run
    withcopy = timed(lambda: [m @ v for _ in range(20)], repeat=1)
    torch.cuda.synchronize()
    figs["copy_interference"] = (max(0.0, withcopy / alone - 1), "bf16 GEMV slowdown during a 1 GiB pinned H2D copy")
    figs["copy_interference_gbs"] = (figs["h2d_pinned_gbs"][0], "the H2D rate during that copy")
    props = torch.cuda.get_device_properties(device)
    figs["device_memory_gb"] = (props.total_memory / 1e9, "torch.cuda.get_device_properties")
    figs["copy_engines"] = (max(1, getattr(props, "async_engine_count", 1) or 1), "device properties (async engines)")
    figs["compute_efficiency"] = (1.0, "bf16_tflops above is measured, already achievable")
    figs["mem_bw_peak_gbs"] = (max(dbw, gemv) / 1e9, "highest measured device bandwidth (no datasheet read)")
    figs["host_mem_bw_gbs"] = (figs["h2d_pinned_gbs"][0], "not measured separately: the pinned H2D rate is a floor")
    facts = {"gpu": props.name, "bf16_gemv_gbs": f"{gemv / 1e9:.0f}"}
    try:
        import pynvml  # optional (nvidia-ml-py): the NVML facts are extras

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        facts.update({
            "nvml_name": str(pynvml.nvmlDeviceGetName(h)),
            "memory_total_gb": f"{pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9:.1f}",
            "pcie_max": f"gen {pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)} x{pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)}",
            "pcie_now": f"gen {pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)}",
            "sm_clock_mhz": str(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": str(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
        })
    except Exception as e:  # NVML is optional: the profile still has every measured figure
        facts["nvml"] = f"unavailable ({type(e).__name__})"
    return figs, facts


def _stream_read_gbs(threads: int, nbytes: int = 256 * 2**20) -> float:
    """GB/s ``threads`` cores read from DRAM: an fp32 GEMV over ``nbytes`` of weights (far
    larger than the caches), the access pattern of a decode step's weight reads."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = nbytes // 4 // 4096
        w, x = torch.randn(rows, 4096), torch.randn(4096)
        return w.numel() * 4 / best_time(lambda: w @ x) / 1e9
    finally:
        torch.set_num_threads(old)


def measure_host(name: str, step: Step | None = None) -> HostProfile:
    """This machine's CPU as a host profile (``hwprofiles/hosts`` format), every figure
    measured: memory bandwidth with all cores and with one (an fp32 GEMV over 256 MiB),
    the bf16 rate (a 1024^3 GEMM, or the fp32 one where that is faster: engines without
    native bf16 kernels convert) and, as int8 dot products have no portable torch kernel,
    the int8 rate taken as twice that (marked so); the host pool's
    per-expert dispatch and round trip from tiny jobs; RAM from the OS. Rates are what
    the measured kernels reach, so ``compute_efficiency`` is 1."""
    step = step or (lambda what: None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    when = datetime.now(UTC).isoformat(timespec="seconds")
    src = f"moesim profile --hardware on {socket.gethostname()} ({platform.processor() or platform.machine()}), {when}"
    step("host memory bandwidth")
    all_bw, one_bw = _stream_read_gbs(cores), _stream_read_gbs(1)
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    fp32 = 2 * n**3 / best_time(lambda: a @ b) / 1e12
    a, b = a.bfloat16(), b.bfloat16()
    bf16 = 2 * n**3 / best_time(lambda: a @ b) / 1e12
    # An engine runs bf16 weights at the faster of the two: on a CPU without AVX512-BF16 or
    # AMX, torch's bf16 GEMM is a slow fallback (150x below fp32 on an AVX2 EPYC), while
    # llama.cpp's and PyTorch's CPU experts convert to fp32 and multiply there.
    rate, how = (bf16, "bf16 GEMM") if bf16 >= fp32 else (fp32, f"fp32 GEMM (faster here than bf16's {bf16:.4g})")
    tiny = [[torch.zeros(3 * 8 * 8) for _ in range(4)]]
    ids, gates = np.array([[0, 1, 2, 3]]), torch.ones(1, 4)
    with HostExperts(8, 8, weights=tiny, workers=1) as pool:
        one = best_time(lambda: pool.submit(0, torch.zeros(1, 8), ids, gates, [0]).result())
        four = best_time(lambda: pool.submit(0, torch.zeros(1, 8), ids, gates, [0, 1, 2, 3]).result())
    figs = {
        "cores": (cores, "CPU cores this process may run on (os.sched_getaffinity)"),
        "mem_bw_peak_gbs": (max(all_bw, one_bw), "the higher of the two GEMV reads below (no datasheet peak here)"),
        "mem_bw_achievable_gbs": (all_bw, f"fp32 GEMV over 256 MiB of weights on {cores} threads: bytes / time"),
        "mem_bw_per_core_gbs": (one_bw, "the same GEMV on one thread"),
        "bf16_tflops": (rate, f"{how} 1024^3 on {torch.get_num_threads()} threads"),
        "int8_tops": (2 * rate, "twice the bf16 rate above (no portable int8 GEMM in torch to time)"),
        "compute_efficiency": (1.0, "the rates above are measured, already achievable"),
        "expert_dispatch_us": (max((four - one) / 3 * 1e6, 0.01), "host pool: extra time per expert of a 4-expert job"),
        "activation_roundtrip_us": (max(one * 1e6, 0.01), "host pool: a 1-expert job's hand-off and return"),
        "ram_gb": (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, "physical memory (sysconf)"),
    }
    figures = {k: Figure(int(v) if HOST_FIGURES[k][2] else round(float(v), 4), "measured", f"{src}: {how}")
               for k, (v, how) in figs.items()}
    return HostProfile(name, f"measured on {socket.gethostname()}: {cores} cores", figures)


def measure(device: str, name: str | None, step: Step) -> HardwareProfile:
    dev = torch.device(device)
    figs, facts = measure_cuda(dev, step) if dev.type == "cuda" else measure_cpu(step)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    host = socket.gethostname()
    what = facts.get("gpu") or facts.get("cpu")
    figures = {k: Figure(round(float(figs[k][0]), 4) if k != "copy_engines" else int(figs[k][0]), "measured",
                         f"moesim profile --hardware on {host} ({what}), {when}: {figs[k][1]}")
               for k in FIGURES if k in figs}
    desc = f"measured on {host}: " + ", ".join(f"{k} {v}" for k, v in facts.items())
    link = "emulated" if dev.type == "cpu" else "pcie5"
    if dev.type == "cuda" and "GH200" in facts.get("gpu", ""):
        link = "nvlink-c2c"
    elif dev.type == "cuda" and "pcie_max" in facts:
        link = {"gen 3": "pcie3", "gen 4": "pcie4", "gen 5": "pcie5"}.get(facts["pcie_max"].split(" x")[0], "pcie5")
    return HardwareProfile(name or f"measured-{host}-{dev.type}", desc, link, figures)


def measure_to_file(device: str, name: str | None, out: Path | None, threads: int,
                    step: Step) -> tuple[HardwareProfile, Path]:
    """``moesim profile --hardware``: measure this machine and write the profile (TOML) to
    ``out``, by default ``./<name>.toml`` in the current directory (never into the
    package's hwprofiles/); what was written must load back."""
    if out is not None:
        check_output_file(out, (".toml",))
    elif name is not None:
        check_output_file(Path(f"{name}.toml"), (".toml",))
    else:
        check_output_file(Path("measured.toml"), (".toml",))  # the folder it will land in
    torch.set_num_threads(threads)
    check_device(device)
    prof = measure(device, name, step)
    path = out or Path(f"{prof.name}.toml")
    atomic_write_text(path, f"# {prof.description}\n" + prof.to_toml())
    get_profile(str(path))
    if device == "cpu":  # the same machine as a host, for --host (an all-CPU deployment, CPU experts)
        host = measure_host(f"{prof.name}-host", step)
        host_path = path.with_name(f"{path.stem}-host.toml")
        atomic_write_text(host_path, f"# {host.description}\n" + host.to_toml())
        get_host(str(host_path))
    return prof, path
