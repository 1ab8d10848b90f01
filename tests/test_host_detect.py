"""``--host this``: this machine's host profile from what the OS says (real /proc files, and
the /proc texts of machines people own), each figure saying whether it was detected."""

from __future__ import annotations

import json

import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_host, this_host
from moesim.host_detect import description_isa, read_facts


def cpuinfo(model: str, flags: str, sockets: int, cores: int, threads_per_core: int = 2) -> str:
    """A /proc/cpuinfo text as Linux writes it: one block a logical CPU."""
    blocks, n = [], 0
    for s in range(sockets):
        for c in range(cores):
            for _ in range(threads_per_core):
                blocks.append(f"processor\t: {n}\nvendor_id\t: x\nmodel name\t: {model}\nphysical id\t: {s}\n"
                              f"core id\t\t: {c}\nflags\t\t: fpu sse2 {flags}\n")
                n += 1
    return "\n".join(blocks) + "\n"


MEMINFO = "MemTotal:       65536000 kB\nMemFree:        1000 kB\n"
ZEN4 = "avx2 avx512f avx512_bf16 avx512_vnni"
SPR = "avx2 avx512f avx512_bf16 amx_bf16 amx_int8 amx_tile"


def test_the_os_facts_are_read_as_linux_writes_them():
    f = read_facts(cpuinfo("Intel(R) Xeon(R) Platinum 8480+", SPR, 2, 56), MEMINFO)
    assert (f.sockets, f.cores, f.isa) == (2, 56, "amx") and f.ram_gb == pytest.approx(67.1, abs=0.1)
    assert read_facts(cpuinfo("AMD Ryzen 9 7950X 16-Core Processor", ZEN4, 1, 16)).isa == "avx512-bf16"
    assert read_facts(cpuinfo("Intel(R) Core(TM) i7-8700", "avx avx2 fma", 1, 6)).isa == "avx2"
    arm = "processor\t: 0\nBogoMIPS\t: 2000\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"
    assert read_facts(arm).isa == "arm"


def test_a_named_part_is_that_part_with_the_detected_cores_sockets_and_ram():
    h = this_host(read_facts(cpuinfo("Intel(R) Xeon(R) Platinum 8480+", SPR, 2, 56), MEMINFO))
    known = get_host("xeon-8480")
    assert h.name == "this" and "xeon-8480" in h.description and "names it" in h.description
    assert (h.cores, h.sockets) == (56, 2) and h.figures["cores"].kind == "measured"
    assert h.figures["ram_gb"].kind == "measured" and h.figures["ram_gb"].value == pytest.approx(67.1, abs=0.1)
    assert h["mem_bw_achievable_gbs"] == known["mem_bw_achievable_gbs"] and h.has_amx
    assert h["amx_bf16_tflops"] == pytest.approx(known["amx_bf16_tflops"])  # same cores: same rates
    others = [k for k, f in h.figures.items() if k not in ("cores", "sockets", "ram_gb")]
    assert others and all(h.figures[k].kind == "estimate" and "xeon-8480" in h.figures[k].source for k in others)


def test_an_unnamed_part_takes_the_nearest_of_its_class_with_rates_scaled_to_its_cores():
    """A VM's 'AMD EPYC' with AVX-512 BF16 and 2 cores: the AVX-512 BF16 part with the
    nearest core count, its peak rates scaled to 2 cores; never an AMX or AVX2 part."""
    h = this_host(read_facts(cpuinfo("AMD EPYC", ZEN4, 1, 2, 1), MEMINFO))
    base = h.description.split("from ")[1].split(" ")[0]
    assert description_isa(get_host(base).description) == "avx512-bf16" and not h.has_amx
    assert h.cores == 2 and h["bf16_tflops"] == pytest.approx(get_host(base)["bf16_tflops"] * 2 / get_host(base).cores)
    assert "xeon-8592plus" in this_host(read_facts(cpuinfo("INTEL(R) XEON(R) PLATINUM 8592+", SPR, 2, 64))).description
    assert "epyc-9575f" in this_host(read_facts(cpuinfo("AMD EPYC 9575F 64-Core Processor", ZEN4, 1, 64))).description
    big = this_host(read_facts(cpuinfo("AMD EPYC 9999 (an unreleased part)", ZEN4, 1, 96)))
    assert "epyc-9654" in big.description  # same class, 96 cores
    old = this_host(read_facts(cpuinfo("AMD EPYC 7000-something", "avx avx2", 1, 64)))
    assert "epyc-7742" in old.description  # AVX2, 64 cores


def test_every_built_in_host_has_an_instruction_set_class():
    from moesim.hardware import builtin_hosts

    classes = {n: description_isa(get_host(n).description) for n in builtin_hosts()}
    assert "other" not in classes.values(), classes
    assert classes["xeon-8480"] == "amx" and classes["epyc-9654"] == "avx512-bf16"
    assert classes["i9-10900x"] == "avx512" and classes["epyc-7343"] == "avx2" and classes["grace"] == "arm"
    assert classes["gb10-grace"] == "arm" and classes["ryzen-5950x"] == "avx2"


def test_no_processor_listed_is_one_line():
    with pytest.raises(MoesimError, match="lists no processor") as e:
        read_facts("")
    assert "\n" not in str(e.value)


def test_this_machine_from_the_command_line(tmp_path):
    """The real /proc files of the machine the suite runs on, through the CLI."""
    from cli_run import in_process

    r = in_process("hw", "this", "--hosts", "--json")
    assert r.returncode == 0, r.stderr
    h = json.loads(r.stdout)[0]
    assert h["name"] == "this" and h["figures"]["cores"]["kind"] == "measured" and h["figures"]["cores"]["value"] >= 1
    assert h["figures"]["ram_gb"]["kind"] == "measured"
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "none", "--host", "this", "--policy", "all-resident",
                   "--tokens", "2", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["rows"][0]["host"] == "this"


def test_a_small_vm_on_a_big_part_is_given_the_bandwidth_its_cores_draw():
    """A 4-core VM whose model name is an EPYC 9654 (96 cores a socket) was given the whole
    socket's 12-channel bandwidth; now its cores' share, labelled, pointing to the measurement."""
    base = get_host("epyc-9654")
    h = this_host(read_facts(cpuinfo("AMD EPYC 9654 96-Core Processor", ZEN4, 1, 4), MEMINFO))
    f = h.figures["mem_bw_achievable_gbs"]
    assert f.value == pytest.approx(4 * base["mem_bw_per_core_gbs"]) and f.value < base["mem_bw_achievable_gbs"]
    assert f.kind == "estimate" and "profile --hardware" in f.source and "4 detected cores" in f.source
    full = this_host(read_facts(cpuinfo("AMD EPYC 9654 96-Core Processor", ZEN4, 1, 96), MEMINFO))
    assert full["mem_bw_achievable_gbs"] == base["mem_bw_achievable_gbs"]  # the whole part: its own figure
