"""``--hw this``: the GPUs NVML reports, each figure saying whether it was detected, derived
or taken from the nearest known part (issue "Predictions that hold where nothing was
fitted", item 4). No GPU here: NVML is replaced by a stand-in module with its API's names."""

from __future__ import annotations

import json
import sys
import types

import pytest

from moesim.errors import MoesimError
from moesim.gpu_detect import GpuFacts, read_gpus
from moesim.hardware import get_machine, this_gpu
from tests.cli_run import in_process


class _Err(Exception):
    pass


def fake_nvml(gpus: list[dict], fail_init: str | None = None, unsupported: tuple[str, ...] = ()):
    """A module with pynvml's names answering for ``gpus`` (name, memory bytes, bus bits, memory
    MHz, PCIe generation and width); ``unsupported`` queries raise NVMLError, as on virtual GPUs."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _Err
    m.NVML_CLOCK_MEM = 2
    state = {"init": 0}

    def init():
        if fail_init:
            raise _Err(fail_init)
        state["init"] += 1

    def ask(key):
        def fn(h, *_):
            if key in unsupported:
                raise _Err("Not Supported")
            return gpus[h][key]
        return fn

    m.nvmlInit, m.nvmlShutdown = init, lambda: state.update(init=state["init"] - 1)
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: gpus[h]["name"].encode()  # older bindings return bytes
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=gpus[h]["memory"])
    m.nvmlDeviceGetMemoryBusWidth = ask("bus")
    m.nvmlDeviceGetMaxClockInfo = ask("clock")
    m.nvmlDeviceGetMaxPcieLinkGeneration = ask("gen")
    m.nvmlDeviceGetMaxPcieLinkWidth = ask("width")
    m.state = state
    return m


RTX4090 = {"name": "NVIDIA GeForce RTX 4090", "memory": 25_757_220_864, "bus": 384, "clock": 10501, "gen": 4, "width": 16}
A4000 = {"name": "NVIDIA RTX A4000", "memory": 17_171_480_576, "bus": 256, "clock": 7001, "gen": 4, "width": 16}


def test_a_known_gpu_keeps_its_datasheet_and_takes_what_nvml_says(monkeypatch):
    nvml = fake_nvml([RTX4090, RTX4090])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    m = get_machine("this")
    assert m.n_gpus == 2 and m.name == "2xthis-rtx4090" and nvml.state["init"] == 0  # NVML shut down again
    g = m.gpus[0]
    assert g.name == "this-rtx4090" and g.host == "this" and g.link == "pcie4"
    assert g.figures["device_memory_gb"].kind == "measured" and g["device_memory_gb"] == pytest.approx(25.76, abs=0.01)
    assert g["mem_bw_peak_gbs"] == pytest.approx(1008.1, abs=0.1)  # 384 bits x 10,501 MHz x 2
    assert g.figures["bf16_tflops"].kind == "datasheet"  # the same part: its datasheet applies


def test_an_unknown_gpu_takes_the_nearest_part_and_says_so():
    g = this_gpu(GpuFacts(A4000["name"], A4000["memory"] / 1e9, 256, 7001, 4, 16))
    assert g.name == "this-gpu" and "no built-in profile is named 'NVIDIA RTX A4000'" in g.description
    assert g["mem_bw_peak_gbs"] == pytest.approx(256 / 8 * 7001 * 2 / 1000, abs=0.05)
    assert g.figures["bf16_tflops"].kind == "estimate" and "nearest known part" in g.figures["bf16_tflops"].source


def test_a_slower_link_scales_the_copy_rate():
    fast = this_gpu(GpuFacts(RTX4090["name"], 25.7, 384, 10501, 4, 16))
    slow = this_gpu(GpuFacts(RTX4090["name"], 25.7, 384, 10501, 3, 8))
    assert slow.link == "pcie3" and slow["h2d_pinned_gbs"] == pytest.approx(fast["h2d_pinned_gbs"] * 0.985 * 8 / (1.969 * 16), abs=0.01)


def test_queries_a_gpu_does_not_answer_keep_the_parts_figures(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX4090], unsupported=("bus", "clock", "gen", "width")))
    (f,) = read_gpus()
    assert f.bus_bits is None and f.mem_bw_peak_gbs is None
    g = this_gpu(f)
    assert g["mem_bw_peak_gbs"] == 1008.0 and g["h2d_pinned_gbs"] == 25.0


@pytest.mark.parametrize("nvml,message", [(lambda: fake_nvml([], fail_init="NVML Shared Library Not Found"), "NVML did not start"),
                                          (lambda: fake_nvml([]), "NVML sees no GPU"),
                                          (lambda: None, "pip install nvidia-ml-py")])
def test_no_gpu_is_one_line_naming_the_way_on(monkeypatch, nvml, message):
    monkeypatch.setitem(sys.modules, "pynvml", nvml())  # None: an import of it fails
    with pytest.raises(MoesimError, match=message):
        get_machine("this")
    r = in_process("whatif", "--hw", "this", "--tokens", "4")
    assert r.returncode == 2 and message in r.stderr and "--hw none" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_whatif_and_hw_answer_for_this_machine(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX4090]))
    r = in_process("hw", "this", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["figures"]["device_memory_gb"]["kind"] == "measured"
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "this", "--policy", "all-resident,cpu-static",
                   "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert {x["hw"] for x in rows} == {"this-rtx4090"} and {x["host"] for x in rows} >= {"this"}


@pytest.mark.parametrize("name, memory, bus, clock, gen, part, link", [
    ("NVIDIA H100 NVL", 94, 6144, 2619, 5, "h100-sxm", "pcie5"),  # a PCIe card: never GH200's NVLink-C2C
    ("NVIDIA GH200 144G HBM3e", 144, 6144, 2619, 5, "gh200", "nvlink-c2c"),  # holds "h200" too
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 96, 512, 14000, 5, "rtx-pro-6000-maxq", "pcie5"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 96, 512, 14000, 5, "rtx-pro-6000-blackwell", "pcie5"),
    ("NVIDIA H100 80GB HBM3", 80, 5120, 2619, 5, "h100-sxm", "pcie5"),  # NVML's name for the SXM part
    ("NVIDIA A100 80GB PCIe", 80, 5120, 1512, 4, "a100-pcie", "pcie4"),
    ("NVIDIA A100-SXM4-80GB", 80, 5120, 1593, 4, "a100-sxm", "pcie4"),
    ("NVIDIA L4", 24, 192, 6251, 4, "l4", "pcie4"),  # an L4 is no L40S
    ("NVIDIA L40", 48, 384, 9001, 4, "l40s", "pcie4"),  # nor an L40 an L4: its family's nearest bandwidth
    ("NVIDIA RTX 6000 Ada Generation", 48, 384, 10001, 4, "rtx-6000-ada", "pcie4"),
    ("NVIDIA GeForce RTX 5060 Ti", 16, 128, 14001, 5, "rtx5060ti", "pcie5"),
    ("NVIDIA GeForce RTX 3080", 10, 320, 9501, 4, "rtx3080", "pcie4"),
    ("NVIDIA GeForce RTX 3070 Ti", 8, 256, 9501, 4, "rtx3070", "pcie4"),
    ("NVIDIA GeForce RTX 3060", 12, 192, 7501, 4, "rtx3060", "pcie4"),
    ("Tesla T4", 15, 256, 5001, 3, "t4", "pcie3"),
    ("NVIDIA B200", 180, 8192, 3996, 5, "b200", "pcie5"),
    ("NVIDIA GB10", 119, 256, 8533, 5, "gb10", "nvlink-c2c"),
])
def test_nvml_names_map_to_the_right_part(name, memory, bus, clock, gen, part, link):
    """NVML's own device names (nvmlDeviceGetName) map to the part they are, by the most specific
    name, and a card whose name claims no NVLink-C2C never gets that host link."""
    from moesim.hardware import nearest_gpu

    base, why, _ = nearest_gpu(GpuFacts(name, memory, bus, clock, gen, 16))
    assert base.name == part, why
    assert this_gpu(GpuFacts(name, memory, bus, clock, gen, 16)).link == link


def test_a_gpu_count_no_machine_has_is_one_line(monkeypatch):
    nvml = fake_nvml([RTX4090])
    nvml.nvmlDeviceGetCount = lambda: 100_000
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(MoesimError, match="100000 GPUs, which no machine has"):
        read_gpus()
