"""Replaying a trace as if its model's experts were stored in another format (or the whole
model as a llama.cpp file type such as Q4_K_M: ``moesim.quant_recipes``).

``--expert-dtype`` asks what a quantised deployment of the traced model would do: the
same routing, experts of ``ModelSpec.with_expert_dtype`` size (so every copy, every read
and what fits on the device change). Two honest limits: the routing is the recorded
one (quantised weights shift router inputs slightly, so real routing would differ a
little), and measured timings are dropped (they were measured at the original format),
so the replay is timed from the profiles.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from moesim.quant_recipes import store_as
from moesim.traces.format import Trace


def with_expert_dtype(trace: Trace, dtype: str) -> Trace:
    """``trace`` with its model's routed experts in ``dtype`` (or stored as the llama.cpp file
    type ``dtype``) and no measured timings."""
    spec = store_as(trace.model, dtype)  # validates the format and the geometry
    if spec is trace.model or spec.to_dict() == trace.header["model"]:
        return trace
    header = copy.deepcopy(trace.header)
    header["model"] = spec.to_dict()
    return replace(trace, header=header, timings={})
