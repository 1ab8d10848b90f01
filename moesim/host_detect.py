"""``--host this``: what the operating system says of the machine moesim runs on
(:func:`moesim.hardware.this_host` builds its host profile from it).

What the operating system tells is taken as measured: the CPU's model name, its sockets
and physical cores (``/proc/cpuinfo``), its instruction sets (the ``flags`` line: AMX,
AVX-512 with or without BF16, AVX2, or an Arm core) and the RAM (``/proc/meminfo``). What
it does not tell (the memory channels and their speed, the kernels' rates) comes from the
nearest known part: the built-in host profile whose model number the model name holds,
else the one of the same instruction-set class with the nearest core count. Its rates are
scaled to the detected cores; its memory system is taken as it is, and every figure says
which of the three it is (``measured``, from the nearest part, or an estimate), so
``moesim hw this --hosts`` shows what the answer rests on. (How the "will it run on my
machine" tools work: detect what the OS exposes, look the rest up by part.)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from moesim.errors import MoesimError

#: Instruction-set classes, most capable first: the flag that marks each in ``/proc/cpuinfo``,
#: and the words a built-in host's description uses for it.
ISA_CLASSES = (("amx", "amx_bf16", "AMX"), ("avx512-bf16", "avx512_bf16", "AVX-512 BF16"),
               ("avx512", "avx512f", "AVX-512"), ("avx2", "avx2", "AVX2"))


@dataclass(frozen=True)
class CpuFacts:
    """What the OS says of this machine's CPU and memory."""

    model: str
    sockets: int
    cores: int  # physical cores of one socket
    isa: str  # one of ISA_CLASSES' names, or "arm" / "other"
    ram_gb: float | None


def read_facts(cpuinfo: str, meminfo: str = "") -> CpuFacts:
    """:class:`CpuFacts` from the text of ``/proc/cpuinfo`` and ``/proc/meminfo``."""
    blocks = [dict(_fields(b)) for b in cpuinfo.strip().split("\n\n") if b.strip()]
    procs = [b for b in blocks if "processor" in b]
    if not procs:
        raise MoesimError("--host this: /proc/cpuinfo lists no processor; give a host profile (`moesim hw --hosts`)")
    first = procs[0]
    model = first.get("model name") or first.get("Model") or first.get("CPU part") or "unknown CPU"
    sockets = len({b.get("physical id", "0") for b in procs})
    cores = {(b.get("physical id", "0"), b.get("core id", b["processor"])) for b in procs}
    flags = set(first.get("flags", first.get("Features", "")).split())
    if "CPU implementer" in first or "asimd" in flags:
        isa = "arm"
    else:
        isa = next((name for name, flag, _ in ISA_CLASSES if flag in flags), "other")
    mem = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.M)
    return CpuFacts(model.strip(), sockets, max(1, len(cores) // sockets), isa,
                    int(mem.group(1)) * 1024 / 1e9 if mem else None)


def _fields(block: str):
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            yield key.strip(), value.strip()


def description_isa(description: str) -> str:
    """A built-in host's instruction-set class, from the words of its description."""
    if any(w in description for w in ("Neoverse", "Grace", "Cortex")):  # Arm cores
        return "arm"
    text = re.sub(r"no (AMX|AVX-512)\S*", "", description)
    return next((name for name, _, words in ISA_CLASSES if words in text), "other")


def read_this_machine() -> CpuFacts:
    """:func:`read_facts` of ``/proc/cpuinfo`` and ``/proc/meminfo``; one line where they cannot be read."""
    try:
        return read_facts(Path("/proc/cpuinfo").read_text(), Path("/proc/meminfo").read_text())
    except OSError as e:
        raise MoesimError(f"--host this reads /proc/cpuinfo and /proc/meminfo (Linux): {e.strerror or e}; "
                          "give a host profile (`moesim hw --hosts`)") from None


def available_memory() -> float:
    """Bytes this process can still allocate: MemAvailable, or the cgroup limit or what is left
    of the address-space limit if lower."""
    avail = float("inf")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw != "max" and int(raw) < 2**60:
                with open(usage_file) as f:
                    avail = min(avail, int(raw) - int(f.read().strip()))
                break
        except (OSError, ValueError):
            continue
    if avail == float("inf"):
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:  # an address-space limit (ulimit -v): what is left of it
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            avail = min(avail, soft - used)
    except (ImportError, OSError, ValueError):
        pass
    return float(avail)
