"""A new policy family joins moesim in one class and one registry line (issue 53).

``EveryOtherLayer`` below is such a family, written here and nowhere else: the experts
of every other MoE layer stay in host memory and run on the CPU (a layout no shipped
family makes: cpu-static puts the *first* N layers there). It answers the one question
its family decides (:meth:`Policy.layout`) and inherits the rest from
:class:`moesim.policy.WithHost`; registered, ``replay``'s simulator and ``whatif``'s
sweep and deployment answer run it with no other file touched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from moesim.models import get_model
from moesim.policy import WithHost, get_policy, register
from moesim.policy import families as registry
from moesim.setting import Setting
from moesim.sim.simulate import simulate
from moesim.traces.synthetic import SyntheticParams, synthetic_trace
from tests.cli_run import in_process


@dataclass(frozen=True, kw_only=True)
class EveryOtherLayer(WithHost):
    """The experts of every other MoE layer on the CPU, the rest resident on one GPU."""

    rank: ClassVar[int] = 3
    range_kind: ClassVar[str] = "experts on the CPU"  # the published class its range comes from

    def row_words(self, row):  # its words in the answer's table
        return "odd MoE layers on CPU"

    def layout(self, spec, machine, make, fits, knobs, hot_placement=None):
        on_gpu = np.zeros((spec.n_moe_layers, spec.n_experts), bool)
        on_gpu[::2] = True  # MoE layers 0, 2, 4, ... on the GPU; 1, 3, 5, ... on the CPU
        return make(hot=on_gpu, source="every other MoE layer's experts on the CPU")


@pytest.fixture
def every_other_layer():
    saved = dict(registry._REGISTRY), dict(registry._ALIASES)
    register(EveryOtherLayer(name="every-other-layer", summary="odd MoE layers' experts on the CPU"))  # the one line
    yield get_policy("every-other-layer")
    for live, old in zip((registry._REGISTRY, registry._ALIASES), saved, strict=True):
        live.clear()
        live.update(old)


def test_the_simulator_runs_a_family_it_has_never_seen(every_other_layer):
    spec = get_model("olmoe-1b-7b")
    trace = synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=32, seed=5))
    res = simulate(trace, "rtx4090", every_other_layer, Setting(host="ryzen-7950x"))
    resident = simulate(trace, "rtx4090", "all-resident", Setting(host="ryzen-7950x"))
    on_cpu = res.placement.resident if res.placement is not None else None
    assert on_cpu is None or not on_cpu[1::2].any()
    assert res.run.n_cpu[:, 1::2].all() and not res.run.n_cpu[:, ::2].any()  # the family's decision, step by step
    assert res.tpot.mean() > resident.tpot.mean()  # half the experts on the CPU cost time an all-resident GPU saves


def test_whatif_sweeps_it_and_the_deployment_answer_names_it(every_other_layer, tmp_path):
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "rtx4090", "--host", "ryzen-7950x", "--policy",
                   "every-other-layer,cpu-static", "--tokens", "4", "--jobs", "1", "--json", "--out", tmp_path / "w")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "w" / "whatif.json").read_text())["rows"]
    mine = [row for row in rows if row["policy"] == "every-other-layer"]
    assert mine and all(row["family"] == "every-other-layer" and row["fits"] for row in mine)
    assert all(row["cpu_expert_share"] > 0.3 for row in mine)  # about half the routed experts ran on the CPU
    families = {f["family"]: f for f in json.loads((tmp_path / "w" / "whatif.json").read_text())["deployment"][0]["families"]}
    assert families["every-other-layer"]["configurations"] == len(mine) and families["every-other-layer"]["row"]
    assert list(families).index("every-other-layer") > list(families).index("gpu-layers")  # ranked by its class's rank
    from moesim.sim.answer import configuration
    from moesim.sim.intervals import kind_of

    assert configuration(mine[0]).startswith("odd MoE layers on CPU")  # the family's words, no table elsewhere
    assert kind_of("every-other-layer", 1) == "experts on the CPU" and mine[0]["range_basis"]



def test_a_host_knob_reaches_both_commands_cost_models_by_name():
    """Issue 53's knob in 3 files: HostKnobs (moesim/setting.py), the cost model's parameter
    (moesim/costmodel.py) and its option (moesim.cli.options.HostOptions) share one name,
    and replay's setting, whatif's options and the sweep inherit it; ``--no-amx``, declared
    there once, reaches whatif's CPU rows (an AMX host at batch 512, where the CPU's experts
    are compute-bound: slower without it)."""
    import inspect
    from dataclasses import fields

    from moesim.cli.options import HostOptions
    from moesim.costmodel import CostModel
    from moesim.setting import HostKnobs, Setting
    from moesim.sim.sweep import Sweep
    from moesim.sim.whatif import WhatifOptions

    names = {f.name for f in fields(HostKnobs)}
    assert names == {f.name for f in fields(HostOptions)} <= set(inspect.signature(CostModel).parameters)
    assert all(issubclass(c, HostKnobs) for c in (Setting, WhatifOptions, Sweep))
    tpot = {}
    for amx in ("--amx", "--no-amx"):
        r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "h100-sxm", "--host", "xeon-8480", "--policy",
                       "cpu-static", "--cpu-layers", "48", "--cache-gib", "0", "--tokens", "4", "--batch", "512",
                       "--jobs", "1", amx, "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        tpot[amx] = json.loads(r.stdout)["best"]["tpot_ms"]
    assert tpot["--no-amx"] > tpot["--amx"]
