"""How one configuration is set up: every knob of a deployment but the trace, the machine and
the policy, as one value built once (by the CLI, a sweep or a Python caller) and handed down
to :func:`moesim.sim.simulate.simulate` and the step models it picks
(:func:`moesim.sim.static.simulate_static`, :func:`moesim.sim.cpu_compute.simulate_cpu_compute`).
Vidur's configs built once and passed as objects are the model: no layer re-reads a dozen
keyword arguments, and a new knob is one field here."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # an annotation only: the setting layer sits below the engines
    from moesim.engines import EngineProfile


@dataclass(frozen=True, kw_only=True)
class HostKnobs:
    """The knobs that set up the host's CPU as the cost model prices it: ``threads`` (the
    engine's CPU threads; None: every core of the host) and ``amx`` (use the host's AMX rate
    where it has one). A :class:`Setting`, ``moesim whatif``'s options and its sweep are
    HostKnobs, and :meth:`moesim.costmodel.CostModel.of` hands them over by name: a knob added
    here, with its parameter of the cost model and its option (``moesim.cli.options.HostOptions``),
    reaches the cost model from ``replay`` and ``whatif`` alike (3 files)."""

    threads: int | None = None
    amx: bool = True

    def host_knobs(self) -> dict[str, Any]:
        """The host knobs, by name (the cost model's parameters)."""
        return {f.name: getattr(self, f.name) for f in fields(HostKnobs)}


@dataclass(frozen=True)
class Setting(HostKnobs):
    """One configuration's knobs (each ``None`` or ``auto``: the default the docstring says).

    - ``sim``: the simulator, ``simpy`` (the reference) or ``fast`` (the compiled recurrence);
      ``timing``: compute times from ``auto`` (measured when the trace has them for this GPU),
      ``profile`` (the roofline) or ``measured``.
    - ``engine``: the inference engine whose figures time the work (name, .toml or profile;
      None: PyTorch eager); ``threads`` its CPU threads (None: every core of the host), a
      :class:`HostKnobs` field.
    - ``link_gbps``: the host-to-device bandwidth instead of the profile's (a what-if).
    - The cross-token cache: ``cache_gib`` or ``cache_experts`` (experts), ``eviction`` (lru,
      lfu), ``cache_per_layer`` (the size is each MoE layer's); ``copy_queue``: fifo,
      demand-first or cancel-unstarted (None: the trace's own, SimPy only);
      ``lookahead``: MoE layers ahead a prefetch is issued (None: the trace's).
    - Placement: ``gpu_expert_gib`` GiB of the hottest experts kept on the GPU (hot-experts'
      budget, or a copy policy's pinned hot set), counted on ``calibration`` (the
      ``[t, m, b, k]`` routing of a separate trace) or, marked optimistic, on the replayed
      trace itself (``calibrate_on_replay``).
    - The CPU: ``host`` (name, .toml or profile; None: the GPU profile's), ``amx`` (use its
      AMX rate where it has one; a :class:`HostKnobs` field), ``cpu_layers`` (cpu-static's MoE layers on the CPU).
    - Layouts: ``gpu_layers`` (gpu-layers' count), ``offload_gib`` (weight-streaming's GiB
      read over the link every step), ``split`` (layer or tensor) and ``ratios`` (a layer
      split's shares) over the GPUs of a machine of several.
    """

    sim: str = "simpy"
    timing: str = "auto"
    engine: str | EngineProfile | None = None
    link_gbps: float | None = None
    cache_gib: float | None = 0.0  # None, with cache_experts None: as the trace was recorded (a replay's)
    cache_experts: int | None = 0
    eviction: str | None = "lru"  # None: as recorded (a replay's)
    cache_per_layer: bool = False
    copy_queue: str | None = "fifo"
    lookahead: int | None = None
    gpu_expert_gib: float | None = None
    calibration: np.ndarray | None = field(default=None, compare=False, repr=False)
    calibrate_on_replay: bool = False
    host: Any = None
    cpu_layers: int | str = "auto"
    gpu_layers: int | str = "auto"
    offload_gib: float | str = "auto"
    split: str = "layer"
    ratios: tuple[float, ...] | list[float] | None = None


#: Every knob at its default (a default argument: a frozen value, shared safely).
DEFAULT_SETTING = Setting()
