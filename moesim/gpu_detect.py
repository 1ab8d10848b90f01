"""``--hw this``: what NVML says of the GPUs of the machine moesim runs on
(:func:`moesim.hardware.this_gpus` builds their profiles from it).

NVML (NVIDIA's management library, through the ``nvidia-ml-py`` package, imported as
``pynvml``) reports each GPU's name, its memory, its memory bus width and top memory
clock, and the PCIe link it can train to. Taken as measured: the memory size; derived
from what NVML reports: the peak memory bandwidth (bus width x memory clock x 2, the data
rate of DDR-style memory: 384 bits at 10,501 MHz is an RTX 4090's 1,008 GB/s, 5,120 bits
at 1,593 MHz an A100's 2,039 GB/s) and the link's peak (lanes x the generation's per-lane
rate). What NVML does not tell (the tensor rates, what a streaming kernel reaches, the
copy rate a pinned copy reaches over that link) comes from the nearest known part: the
built-in profile whose name the GPU's name holds (the one nearest in memory where several
do), else the one nearest in memory bandwidth; every figure says which it is, so
``moesim hw this`` shows what the answer rests on.

NVML is believed only within what a GPU can be (:func:`checked`): a memory size, bus width,
clock or link outside the range of any GPU made, or not a finite number, is refused in one
line naming the figure and NVML; every call is guarded (a broken binding, a query raising
something other than ``NVMLError``, a shutdown that fails); the GPUs are those an engine
would see (``CUDA_VISIBLE_DEVICES``: indices or ``GPU-`` UUIDs, up to the first entry CUDA
would stop at); and a name's control characters never reach the terminal.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

from moesim.errors import MoesimError
from moesim.fmt import printable

#: GB/s per lane and direction of each PCIe generation after encoding (PCI-SIG: 8 GT/s with
#: 128b/130b for 3.0, doubling with each generation).
PCIE_LANE_GBS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
HINT = "give --hw none for a machine without a GPU, or a GPU profile (`moesim hw`)"
#: What NVML may say and be believed: (lowest, highest) of any GPU made or announced, with room
#: (memory: 1 GB to 1 TB a device; bus: 32 bits to HBM's 8,192; memory clock: 100 MHz to 40 GHz).
#: The most GPUs one machine holds (a 16-GPU HGX node, with room): NVML saying more is broken.
MAX_GPUS = 64
LIMITS = {"memory_gb": (0.5, 1024.0), "bus_bits": (32, 16384), "mem_clock_mhz": (100, 40000),
          "pcie_width": (1, 32)}


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says of one GPU (None: NVML did not say)."""

    name: str
    memory_gb: float
    bus_bits: int | None = None
    mem_clock_mhz: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None

    @property
    def mem_bw_peak_gbs(self) -> float | None:
        if not self.bus_bits or not self.mem_clock_mhz:
            return None
        return self.bus_bits / 8 * self.mem_clock_mhz * 2 / 1000

    @property
    def link_peak_gbs(self) -> float | None:
        if self.pcie_gen not in PCIE_LANE_GBS or not self.pcie_width:
            return None
        return PCIE_LANE_GBS[self.pcie_gen] * self.pcie_width


def checked(f: GpuFacts, index: int) -> GpuFacts:
    """``f`` when every figure is one a GPU can have (:data:`LIMITS`), else one line naming the
    figure; an unknown PCIe generation is left unsaid (the nearest part's link is used)."""
    for key, (low, high) in LIMITS.items():
        v = getattr(f, key)
        if v is None and key != "memory_gb":
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not low <= v <= high:
            raise MoesimError(f"--hw this: NVML says GPU {index} ({f.name}) has {key} = {v!r}, which no GPU has "
                              f"(from {low:g} to {high:g}); the driver or its binding is broken: {HINT}")
    gen = f.pcie_gen if f.pcie_gen in PCIE_LANE_GBS else None
    return GpuFacts(printable(f.name), float(f.memory_gb), f.bus_bits, f.mem_clock_mhz, gen, f.pcie_width)


def _asked(nvml_error, fn, *args):
    """``fn(*args)``, or None where this GPU or driver does not answer it (older GPUs and
    virtual ones leave some queries unsupported; a binding may raise other errors too)."""
    try:
        return fn(*args)
    except (nvml_error, Exception):
        return None


def visible(count: int, uuid_of) -> list[int]:
    """The NVML indices of the GPUs an engine would see: all of them, or those
    ``CUDA_VISIBLE_DEVICES`` lists (indices or ``GPU-`` UUID prefixes, in its order, up to the
    first it cannot resolve, as CUDA does; empty: none)."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    out: list[int] = []
    for item in (x.strip() for x in spec.split(",")):
        if item.isdigit() and int(item) < count:
            i = int(item)
        elif item.upper().startswith("GPU-"):
            matches = [i for i in range(count) if (uuid_of(i) or "").upper().startswith(item.upper())]
            if len(matches) != 1:
                break
            i = matches[0]
        else:
            break
        if i in out:
            break
        out.append(i)
    return out


def read_gpus() -> list[GpuFacts]:
    """:class:`GpuFacts` of every GPU NVML sees and CUDA would show (:func:`visible`), each
    :func:`checked`; one line where NVML is missing, broken, cannot start or sees none."""
    try:
        import pynvml  # nvidia-ml-py: NVIDIA's own Python binding of NVML
    except ImportError:
        raise MoesimError("--hw this reads the GPUs through NVML: pip install nvidia-ml-py; or " + HINT) from None
    nvml_error = getattr(pynvml, "NVMLError", None)
    if not (isinstance(nvml_error, type) and issubclass(nvml_error, BaseException)):
        raise MoesimError(f"--hw this: the pynvml module here is not NVIDIA's binding (no NVMLError): "
                          f"pip install nvidia-ml-py; or {HINT}")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError, or OSError / AttributeError from a broken binding or library
        raise MoesimError(f"--hw this: NVML did not start ({type(e).__name__}: {e}): no NVIDIA driver on this "
                          f"machine? {HINT}") from None
    try:
        def handle(i):
            return pynvml.nvmlDeviceGetHandleByIndex(i)

        def uuid_of(i):
            u = _asked(nvml_error, pynvml.nvmlDeviceGetUUID, handle(i))
            return u.decode() if isinstance(u, bytes) else u

        out = []
        count = pynvml.nvmlDeviceGetCount()
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_GPUS:
            raise MoesimError(f"--hw this: NVML says this machine has {count!r} GPUs, which no machine has (at most "
                              f"{MAX_GPUS} in one node); the driver or its binding is broken: {HINT}")
        for i in visible(count, uuid_of):
            h = handle(i)
            name = pynvml.nvmlDeviceGetName(h)
            facts = GpuFacts(
                name=(name.decode(errors="replace") if isinstance(name, bytes) else str(name)).strip(),
                memory_gb=pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9,
                bus_bits=_asked(nvml_error, pynvml.nvmlDeviceGetMemoryBusWidth, h),
                mem_clock_mhz=_asked(nvml_error, pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
                pcie_gen=_asked(nvml_error, pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=_asked(nvml_error, pynvml.nvmlDeviceGetMaxPcieLinkWidth, h))
            out.append(checked(facts, i))
    except MoesimError:
        raise
    except Exception as e:  # NVMLError, or anything a broken binding raises
        raise MoesimError(f"--hw this: NVML could not read the GPUs ({type(e).__name__}: {e}); {HINT}") from None
    finally:
        with contextlib.suppress(Exception):  # the facts are read; a failing shutdown changes none of them
            pynvml.nvmlShutdown()
    if not out:
        seen = " (CUDA_VISIBLE_DEVICES hides every one)" if os.environ.get("CUDA_VISIBLE_DEVICES") is not None else ""
        raise MoesimError(f"--hw this: NVML sees no GPU on this machine{seen}; {HINT}")
    return out


def name_key(text: str) -> str:
    """A GPU name reduced for matching: ``NVIDIA GeForce RTX 4090`` and ``rtx4090`` both ``rtx4090``."""
    t = text.lower()
    for word in ("nvidia", "geforce", "tesla", "-", " ", "_"):
        t = t.replace(word, "")
    return t
