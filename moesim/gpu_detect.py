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
"""

from __future__ import annotations

from dataclasses import dataclass

from moesim.errors import MoesimError

#: GB/s per lane and direction of each PCIe generation after encoding (PCI-SIG: 8 GT/s with
#: 128b/130b for 3.0, doubling with each generation).
PCIE_LANE_GBS = {3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
HINT = "give --hw none for a machine without a GPU, or a GPU profile (`moesim hw`)"


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


def _asked(fn, *args):
    """``fn(*args)``, or None where this GPU or driver does not answer it (older GPUs and
    virtual ones leave some queries unsupported)."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def read_gpus() -> list[GpuFacts]:
    """:class:`GpuFacts` of every GPU NVML sees; one line where NVML is missing, cannot start
    or sees none."""
    try:
        import pynvml  # nvidia-ml-py: NVIDIA's own Python binding of NVML
    except ImportError:
        raise MoesimError("--hw this reads the GPUs through NVML: pip install nvidia-ml-py; or " + HINT) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise MoesimError(f"--hw this: NVML did not start ({e}): no NVIDIA driver on this machine? {HINT}") from None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(GpuFacts(
                name=(name.decode() if isinstance(name, bytes) else str(name)).strip(),
                memory_gb=pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9,
                bus_bits=_asked(pynvml.nvmlDeviceGetMemoryBusWidth, h),
                mem_clock_mhz=_asked(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM),
                pcie_gen=_asked(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_width=_asked(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)))
    except pynvml.NVMLError as e:
        raise MoesimError(f"--hw this: NVML could not read the GPUs ({e}); {HINT}") from None
    finally:
        pynvml.nvmlShutdown()
    if not out:
        raise MoesimError(f"--hw this: NVML sees no GPU on this machine; {HINT}")
    return out


def name_key(text: str) -> str:
    """A GPU name reduced for matching: ``NVIDIA GeForce RTX 4090`` and ``rtx4090`` both ``rtx4090``."""
    t = text.lower()
    for word in ("nvidia", "geforce", "tesla", "-", " ", "_"):
        t = t.replace(word, "")
    return t
