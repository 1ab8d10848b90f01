"""Importing routing from other engines' dumps: the examples round-trip to the recorded
routing they came from; dumps that do not match the model are one-line errors."""

import json
from pathlib import Path

import numpy as np
import pytest
from cli_run import BOTH_WAYS

from moesim.errors import MoesimError
from moesim.hardware import get_profile
from moesim.setting import Setting
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
    assert simulate(t, get_profile("a6000"), "on-demand", Setting(cache_experts=32, sim="fast")).summary()["tpot_ms"] > 0


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
    # gates in some records only, or fewer gates than experts: refused (the gates given were dropped)
    (_full(gates=[0.4, 0.3, 0.2, 0.1]), r"1 of 8 records give gates \(record 8 does\)"),
    (_full(gates=[0.5]), "1 gate"),
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
    # token ids of another shape than the routing's: refused (were cut or replaced by zeros, silently)
    np.savez(p, experts=np.tile(np.arange(4), (3, 4, 1)), token_ids=np.zeros((3, 3), np.int64))
    with pytest.raises(MoesimError, match=r"token_ids has shape \(3, 3\); the routing has 1 sequence"):
        importers.import_routing("npz", p, MODEL)
    np.savez(p, routed_experts=np.zeros((10, 4, 4), np.int32) + np.arange(4), prompt_tokens=3,
             token_ids=np.arange(50))
    with pytest.raises(MoesimError, match="token_ids holds 50 token"):
        importers.import_routing("vllm", p, MODEL)
    np.save(tmp_path / "plain.npy", np.zeros((3, 4, 4), np.int64))
    with pytest.raises(MoesimError, match="a single .npy array, not an .npz archive"):
        importers.import_routing("npz", tmp_path / "plain.npy", MODEL)
    (tmp_path / "junk.npz").write_bytes(b"nope")
    with pytest.raises(MoesimError, match="not a readable"):
        importers.import_routing("npz", tmp_path / "junk.npz", MODEL)


# --------------------------------------------------------------------------------------
# vLLM's real layout: every layer's row, from .npy, .npz and the server's JSON (synthetic examples)
# --------------------------------------------------------------------------------------

SYNTH = "vllm-synthetic-deepseek-v2-lite"
PROMPT, COMPLETION = 8, 9  # vLLM writes prompt + completion - 1 = 16 rows


def synthetic_vllm_routing(seed: int = 0) -> np.ndarray:
    """[16, 27, 6] uint8 like vLLM's output for deepseek-v2-lite (27 layers, the first dense:
    its row is zeros, as vLLM leaves a layer without a router); synthetic routing."""
    rng = np.random.default_rng(seed)
    r = np.zeros((PROMPT + COMPLETION - 1, 27, 6), np.uint8)
    for t in range(r.shape[0]):
        for layer in range(1, 27):
            r[t, layer] = rng.choice(64, 6, replace=False)
    return r


def write_vllm_examples(folder: Path) -> list[Path]:
    """The committed synthetic examples (tests/test_importers.py regenerates and compares them)."""
    import base64
    import io

    r = synthetic_vllm_routing()
    tokens = np.arange(100, 100 + COMPLETION, dtype=np.int64)
    np.save(folder / f"{SYNTH}.npy", r)
    np.savez(folder / f"{SYNTH}.npz", routed_experts=r, prompt_tokens=PROMPT, token_ids=tokens)
    buf = io.BytesIO()
    np.save(buf, r)
    response = {"id": "cmpl-synthetic", "object": "text_completion", "model": "deepseek-ai/DeepSeek-V2-Lite",
                "choices": [{"index": 0, "text": "(synthetic)", "finish_reason": "length",
                             "token_ids": tokens.tolist(), "routed_experts": base64.b64encode(buf.getvalue()).decode()}],
                "usage": {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
                          "total_tokens": PROMPT + COMPLETION}}
    (folder / f"{SYNTH}.json").write_text(json.dumps(response, indent=1) + "\n")
    return [folder / f"{SYNTH}.{ext}" for ext in ("npy", "npz", "json")]


def test_synthetic_examples_are_what_the_script_writes(tmp_path):
    for made in write_vllm_examples(tmp_path):
        committed = EXAMPLES / made.name
        if made.suffix == ".npz":
            a, b = np.load(made), np.load(committed)
            assert sorted(a.files) == sorted(b.files) and all((a[k] == b[k]).all() for k in a.files)
        else:
            assert made.read_bytes() == committed.read_bytes(), made.name


@pytest.mark.parametrize("ext", ["npy", "npz", "json"])
def test_vllm_rows_of_dense_layers_are_dropped(tmp_path, ext):
    t = importers.import_routing("vllm", EXAMPLES / f"{SYNTH}.{ext}", "deepseek-v2-lite", tmp_path / "t.npz",
                                 prompt_tokens=PROMPT if ext == "npy" else None)
    r = synthetic_vllm_routing()
    assert t.true_ids.shape == (COMPLETION - 1, 26, 1, 6) and t.prompt_len == PROMPT
    np.testing.assert_array_equal(t.true_ids[:, :, 0], r[PROMPT:, 1:])
    if ext != "npy":
        np.testing.assert_array_equal(t.token_ids[0], np.arange(100, 100 + COMPLETION - 1))
    assert read_trace(tmp_path / "t.npz").n_tokens == COMPLETION - 1


def test_sglang_json_is_read(tmp_path):
    import base64

    r = synthetic_vllm_routing()
    body = {"text": "x", "output_ids": list(range(100, 100 + COMPLETION)),
            "meta_info": {"prompt_tokens": PROMPT, "routed_experts": base64.b64encode(r.astype("<i4").tobytes()).decode()}}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(body))
    t = importers.import_routing("sglang", p, "deepseek-v2-lite")
    np.testing.assert_array_equal(t.true_ids[:, :, 0], r[PROMPT:, 1:])


def _npz(tmp_path, **arrays):
    p = tmp_path / "h.npz"
    np.savez(p, **arrays)
    return p


R = synthetic_vllm_routing()


@pytest.mark.parametrize("make, message", [
    (lambda d: _npz(d, routed_experts=R.astype(np.float32) * np.nan, prompt_tokens=8), "must be integers"),
    (lambda d: _npz(d, routed_experts=R > 3, prompt_tokens=8), "must be integers"),
    (lambda d: _npz(d, routed_experts=R.astype(str), prompt_tokens=8), "must be integers"),
    (lambda d: _npz(d, routed_experts=R[0, 0], prompt_tokens=8), r"\[seq_len, layers, top_k\]"),
    (lambda d: _npz(d, routed_experts=R + 64, prompt_tokens=8), "expert id .* outside"),
    (lambda d: _npz(d, routed_experts=R, prompt_tokens=np.float64(8.5)), "prompt_tokens must be one whole number"),
    (lambda d: _npz(d, routed_experts=R, prompt_tokens=True), "prompt_tokens must be one whole number"),
    (lambda d: _npz(d, routed_experts=R[:, :20], prompt_tokens=8), "20 layers; deepseek-v2-lite has 26 MoE"),
    (lambda d: (np.save(d / "p.npy", R), d / "p.npy")[1], "does not say how long the prompt was"),
    (lambda d: ((d / "j.json").write_text('{"choices": [{"routed_experts": 5}], "usage": {"prompt_tokens": 8}}'),
                d / "j.json")[1], "must be a base64 string"),
    (lambda d: ((d / "j.json").write_text('{"choices": [{"routed_experts": "@@@"}]}'), d / "j.json")[1], "not base64"),
    (lambda d: ((d / "j.json").write_text('{"choices": [], "usage": NaN}'), d / "j.json")[1], "not a JSON response"),
    (lambda d: ((d / "j.json").write_text('{"choices": [{"text": "no routing"}]}'), d / "j.json")[1],
     "enable-return-routed-experts"),
])
def test_hostile_vllm_dumps_are_one_line(tmp_path, make, message):
    p = make(tmp_path)
    with pytest.raises(MoesimError, match=message) as e:
        importers.import_routing("vllm", p, "deepseek-v2-lite", tmp_path / "o.npz")
    assert "\n" not in str(e.value) and not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_hostile_dumps_exit_2_with_one_line(tmp_path, run):
    np.save(tmp_path / "p.npy", R)
    _npz(tmp_path, routed_experts=R.astype(np.float64) * np.nan, prompt_tokens=8)
    for f in (tmp_path / "p.npy", tmp_path / "h.npz"):
        r = run("import", "vllm", f, "--model", "deepseek-v2-lite", "--out", tmp_path / "o.npz")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("record, message", [
    ({"token": 0, "layer": 0, "experts": [True, 1, 2, 3]}, "an expert id must be a whole number"),
    ({"token": 0, "layer": 0, "experts": ["a", 1, 2, 3]}, "an expert id must be a whole number"),
    ({"token": 0.5, "layer": 0, "experts": [0, 1, 2, 3]}, "token must be a whole number"),
    ({"token": 0, "layer": 0, "experts": [0, 1, 2, 3], "gates": ["NaN", 1, 1, 1]}, "gates must be a list of numbers"),
])
def test_hostile_jsonl_records_are_one_line(tmp_path, record, message):
    p = _jsonl(tmp_path, [record])
    with pytest.raises(MoesimError, match=message) as e:
        importers.import_routing("jsonl", p, MODEL)
    assert "\n" not in str(e.value)
    p.write_text('{"token": 0, "layer": 0, "experts": [0, 1, 2, 3], "gates": [NaN, 1, 1, 1]}')
    with pytest.raises(MoesimError, match="not a routing record"):
        importers.import_routing("jsonl", p, MODEL)


def test_a_dump_is_read_under_an_address_space_limit(tmp_path):
    """The README's own vLLM example, under `ulimit -v 8000000` (a stranger's round 5): the
    reader asked for its cap (half the machine's memory) in one read and got "out of memory";
    it reads the file's size now, and the budget counts what is left of the limit."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (8_000_000 * 1024, resource.RLIM_INFINITY))

    r = subprocess.run([sys.executable, "-m", "moesim", "import", "vllm", str(EXAMPLES / f"{SYNTH}.npy"),
                        "--prompt-tokens", str(PROMPT), "--model", "deepseek-v2-lite", "--out", str(tmp_path / "v.npz")],
                       capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert r.returncode == 0 and (tmp_path / "v.npz").exists(), r.stderr
