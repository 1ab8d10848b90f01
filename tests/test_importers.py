"""Importing routing from other engines' dumps: the examples round-trip to the recorded
routing they came from; dumps that do not match the model are one-line errors."""

import json
from pathlib import Path

import numpy as np
import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.sim.simulate import simulate
from moesim.traces import importers
from moesim.traces.format import read_trace

EXAMPLES = Path(importers.__file__).resolve().parent / "examples"
MODEL = str(Path(importers.__file__).resolve().parents[1] / "executor" / "checkpoints" / "moe-stdlib")


@pytest.fixture(scope="module")
def recorded():
    return read_trace(EXAMPLES / "moe-stdlib-routing.npz")


def test_vllm_dump_drops_prefill_rows(tmp_path, recorded):
    t = importers.import_routing("vllm", EXAMPLES / "vllm-moe-stdlib.npz", MODEL, tmp_path / "v.npz")
    back = read_trace(tmp_path / "v.npz")
    np.testing.assert_array_equal(back.true_ids[:, :, 0], recorded.true_ids[16:, :, 0])
    assert back.prompt_len == 16 and back.n_tokens == 240 and not back.synthetic
    np.testing.assert_array_equal(back.token_ids[0], recorded.token_ids[0, 16:])
    assert "uniform 1/k" in back.header["recorded"]["how"] and (back.pred_ids == -1).all()
    assert simulate(t, get_profile("a6000"), "on-demand", cache_experts=32, engine="fast").summary()["tpot_ms"] > 0


@pytest.mark.parametrize("fmt, name, steps", [("npz", "routing-moe-stdlib.npz", 64),
                                               ("jsonl", "routing-moe-stdlib.jsonl", 12)])
def test_plain_formats_round_trip(fmt, name, steps, recorded):
    t = importers.import_routing(fmt, EXAMPLES / name, MODEL)
    np.testing.assert_array_equal(t.true_ids, recorded.true_ids[:steps])
    np.testing.assert_allclose(t.true_gates, recorded.true_gates[:steps], atol=1e-6)
    assert t.batch == 2


def _jsonl(tmp_path, records):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in records))
    return p


def _full(k=4, **change):
    recs = [{"token": s, "layer": layer, "experts": list(range(layer, layer + k))} for s in range(2) for layer in range(4)]
    recs[-1].update(change)
    return recs


@pytest.mark.parametrize("records, message", [
    (_full(experts=[0, 1, 2, 40]), "expert id 40 outside"),
    (_full(experts=[0, 1, 1, 2]), "duplicate expert ids"),
    (_full(experts=[0, 1, 2]), "ragged top-k"),
    (_full(layer=9), "layer 9 is not a layer"),
    (_full()[:-1], "no record for token 1, layer 3"),
    (_full(k=2), "top-2"),
])
def test_mismatched_jsonl_dumps_are_refused(tmp_path, records, message):
    with pytest.raises(MoesimError, match=message) as e:
        importers.import_routing("jsonl", _jsonl(tmp_path, records), MODEL)
    assert "\n" not in str(e.value)


def test_mismatched_array_dumps_are_refused(tmp_path):
    p = tmp_path / "v.npz"
    np.savez(p, routed_experts=np.zeros((10, 6, 4), np.int32) + np.arange(4), prompt_tokens=3)
    with pytest.raises(MoesimError, match="6 layers; .* 4 MoE layers"):
        importers.import_routing("vllm", p, MODEL)
    np.savez(p, routed_experts=np.zeros((10, 4, 4), np.int32), prompt_tokens=10)
    with pytest.raises(MoesimError, match="leaves no decode step"):
        importers.import_routing("vllm", p, MODEL)
    # A dense layer counted by the dump: deepseek-v2-lite has 27 layers, 26 MoE.
    np.savez(p, experts=np.tile(np.arange(6), (3, 27, 1)))
    with pytest.raises(MoesimError, match="27 layers; deepseek-v2-lite has 26 MoE layers .*1 dense"):
        importers.import_routing("npz", p, "deepseek-v2-lite")
    with pytest.raises(MoesimError, match="unknown routing format"):
        importers.import_routing("csv", p, MODEL)
    (tmp_path / "junk.npz").write_bytes(b"nope")
    with pytest.raises(MoesimError, match="not a readable"):
        importers.import_routing("npz", tmp_path / "junk.npz", MODEL)
