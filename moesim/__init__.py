"""moesim: performance modelling and a reference executor for offloaded MoE decoding.

This package holds the shared vocabulary (model specs and byte accounting, hardware
profiles, policy decisions) that the simulator (``sim``) and the executor (``executor``)
both import; it never imports torch or SimPy.
"""

__version__ = "0.1.0"
