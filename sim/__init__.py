"""The simulator: replays traces against hardware profiles (SimPy reference + fast path).

Importing it never imports torch.
"""

from moesim.sim.simulate import SimResult, simulate

__all__ = ["SimResult", "simulate"]
