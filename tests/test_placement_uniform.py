"""KTransformers' default placement: uniform (the lowest-numbered experts of every layer,
blind to popularity), the default for hot-experts under that engine; frequency when asked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moesim.engines import get_engine, parse_engine
from moesim.errors import MoesimError
from moesim.models import get_model
from moesim.policy.placement import make_placement, routing_counts, uniform_per_layer, uniform_set
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


def test_uniform_takes_expert_ordinals_round_robin_over_layers():
    spec = get_model("qwen3-30b-a3b")
    m = spec.n_moe_layers
    p = uniform_set(spec, (m + 1) * spec.expert_bytes)  # every layer's expert 0, then layer 0's expert 1
    assert p.n_resident == m + 1 and p.resident[:, 0].all() and p.resident[0, 1] and not p.resident[1:, 1].any()
    assert "uniform placement" in p.source and not p.optimistic
    q = uniform_per_layer(spec, 28)
    assert (q.resident.sum(1) == 28).all() and q.resident[:, :28].all()
    with pytest.raises(MoesimError, match="a count from 0 to 128"):
        uniform_per_layer(spec, 129)


def test_uniform_is_blind_to_popularity_and_frequency_is_not():
    """On a synthetic trace (popularity independent of the ids), uniform's 28 experts a layer
    take about 28/128 of the routes; the 28 most routed take far more."""
    spec = get_model("qwen3-30b-a3b")
    t = synthetic_trace(spec, SyntheticParams(tokens=64, prompt_len=16, seed=0))
    counts = routing_counts(t.true_ids, spec.n_experts)
    share = counts[uniform_per_layer(spec, 28).resident].sum() / counts.sum()
    assert share == pytest.approx(28 / 128, abs=0.05)
    hot = np.sort(counts, axis=1)[:, -28:].sum() / counts.sum()
    assert hot > share + 0.2


def test_hot_experts_is_uniform_under_ktransformers_unless_frequencies_are_given():
    spec = get_model("qwen3-30b-a3b")
    t = synthetic_trace(spec, SyntheticParams(tokens=8, prompt_len=16, seed=0))
    mem = 24e9
    assert get_engine("ktransformers").expert_placement == "uniform"
    assert get_engine("pytorch-eager").expert_placement == "frequency"
    uni = make_placement("hot-experts", spec, mem, strategy="uniform")
    assert "uniform placement" in uni.source
    freq = make_placement("hot-experts", spec, mem, calibration=t.true_ids, strategy="uniform")
    assert "hottest" in freq.source  # a calibration given: by frequency
    with pytest.raises(MoesimError, match="needs expert frequencies"):
        make_placement("hot-experts", spec, mem)  # moesim's own hot-experts: frequencies, or one line


def test_an_engine_placement_is_checked_in_one_line():
    data = {"name": "x", "runs_on": ["gpu"], "figures": {k: {"value": 1, "kind": "estimate", "source": "s"} for k in
                                                          ("attention_kernels", "expert_kernels", "fused_experts",
                                                           "head_kernels", "predict_kernels")}}
    assert parse_engine(data, "x.toml").expert_placement == "frequency"
    with pytest.raises(MoesimError, match="expert_placement is one of frequency, uniform") as e:
        parse_engine({**data, "expert_placement": "hottest"}, "x.toml")
    assert "\n" not in str(e.value)


def test_replay_and_whatif_under_ktransformers_place_uniformly(tmp_path):
    from cli_run import in_process

    from moesim.traces.format import write_trace

    spec = get_model("qwen3-30b-a3b")
    write_trace(synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=16, seed=0)), tmp_path / "q.npz")
    base = ("replay", "q.npz", "--hw", "rtx4090", "--host", "epyc-9355", "--policy", "hot-experts", "--sim", "fast",
            "--json")
    r = in_process(*base, "--engine", "ktransformers", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)[0]
    assert "uniform placement" in row["placement"]
    r = in_process(*base, cwd=tmp_path)  # moesim's own hot-experts still needs the frequencies
    assert r.returncode == 2 and "needs expert frequencies" in r.stderr
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--host", "epyc-9355", "--engine",
                   "ktransformers", "--policy", "hot-experts", "--tokens", "4", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert any("hot-experts places experts as ktransformers does by default" in n for n in out["notes"]), out["notes"]
    assert all("uniform placement" in row["placement"] for row in out["rows"])


def test_the_published_kt_kernel_entries_place_as_the_engine_does():
    from moesim.sim.published import entries, predict

    e = next(e for e in entries() if e.id == "kt-qwen3-30b-bf16-5090-epyc9355-ctx1k")
    res = predict(e)["result"]
    assert "uniform placement" in res.config["placement"] and res.config["resident_experts"] == 28 * 48
