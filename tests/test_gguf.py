"""GGUF files: geometry from the metadata, exact bytes from every tensor's ggml type, split
files followed; moesim's hand-written ggml block table agrees with gguf-py's."""

from __future__ import annotations

import dataclasses
import json
import shlex

import gguf
import pytest
from cli_run import BOTH_WAYS
from gguf_files import T, qwen3moe_gguf

from moesim.errors import MoesimError
from moesim.gguf_file import spec_from_gguf
from moesim.models import GGML_BLOCKS, INTEGER_DTYPES, get_model, matrix_bytes


def test_ggml_block_table_matches_gguf_py():
    for name, (per, size) in GGML_BLOCKS.items():
        key = {"mxfp4-gguf": "MXFP4", "nvfp4-gguf": "NVFP4"}.get(name, name.upper())
        assert gguf.GGML_QUANT_SIZES[T[key]] == (per, size), name
        if name not in ("mxfp4-gguf", "nvfp4-gguf"):
            assert name in INTEGER_DTYPES
        assert matrix_bytes(3, 2 * 256, name) == 3 * (2 * 256 // per) * size


def _nbytes(qtype, rows, cols, n=1):
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    return n * rows * (cols // per) * size


def test_q4_k_m_like_file_gives_exact_bytes_per_layer(tmp_path):
    (path,) = qwen3moe_gguf(tmp_path / "m.gguf")  # Q4_K experts, ffn_down Q6_K in layers 0 and 2
    s = spec_from_gguf(path)
    assert (s.n_layers, s.n_experts, s.top_k, s.hidden, s.expert_inter, s.vocab) == (4, 8, 2, 256, 256, 512)
    q4 = 2 * _nbytes(T.Q4_K, 256, 256)
    assert [s.moe_expert_bytes(m) for m in range(4)] == [q4 + _nbytes(T.Q6_K, 256, 256), q4 + _nbytes(T.Q4_K, 256, 256)] * 2
    assert s.expert_bytes == round(sum(s.expert_bytes_by_layer) / 4)  # the mean, documented so
    assert s.all_expert_bytes == 8 * sum(s.expert_bytes_by_layer)
    assert (s.expert_dtype, s.dense_dtype, s.embed_dtype, s.head_dtype) == ("q4_k", "q4_k", "q4_k", "q6_k")
    assert s.input_embedding_bytes == _nbytes(T.Q4_K, 512, 256)
    assert s.embedding_row_bytes == _nbytes(T.Q4_K, 1, 256)
    assert s.lm_head_bytes == _nbytes(T.Q6_K, 512, 256) + 4 * 256  # output.weight + F32 output_norm
    attn = _nbytes(T.Q4_K, 256, 256) * 2 + _nbytes(T.Q4_K, 128, 256) * 2
    assert s.layer_resident_bytes(1) == attn + 4 * (2 * 256 + 2 * 64) + 4 * 8 * 256  # norms, q/k norms, router (F32)
    # Every tensor's stored bytes are accounted for exactly once.
    reader = gguf.GGUFReader(str(path))
    assert sum(int(t.n_bytes) for t in reader.tensors) == s.non_expert_bytes + s.all_expert_bytes


def test_k_quants_and_i_quants_mixed_per_layer(tmp_path):
    gates = [T.Q2_K, T.Q3_K, T.IQ2_XXS, T.IQ4_XS]
    downs = [T.IQ3_S, T.IQ1_M, T.Q5_K, T.Q8_0]
    (path,) = qwen3moe_gguf(tmp_path / "m.gguf", gate_types=gates, down_types=downs)
    s = spec_from_gguf(path)
    want = [2 * _nbytes(g, 256, 256) + _nbytes(d, 256, 256) for g, d in zip(gates, downs)]
    assert [s.moe_expert_bytes(m) for m in range(4)] == want
    assert s.bytes_per_token() == s.non_expert_bytes + 2 * sum(want)
    assert s.with_expert_dtype("bf16").expert_bytes == 3 * 256 * 256 * 2  # a new format drops the file's bytes


def test_split_files_are_followed(tmp_path):
    (one,) = qwen3moe_gguf(tmp_path / "one.gguf")
    parts = qwen3moe_gguf(tmp_path / "m.gguf", parts=3)
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a, b = spec_from_gguf(one), spec_from_gguf(parts[0])
    assert dataclasses.replace(b, source=a.source) == a
    parts[2].unlink()
    with pytest.raises(MoesimError, match="part m-00003-of-00003.gguf is missing"):
        spec_from_gguf(parts[0])


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_models_command_reads_a_gguf_file_and_folder(tmp_path, run):
    (path,) = qwen3moe_gguf(tmp_path / "m.gguf")
    for arg in (str(path), str(tmp_path)):
        r = run("models", arg, "--json")
        assert r.returncode == 0, r.stderr
        row = json.loads(r.stdout)["models"][0]
        assert row["expert_dtype"] == "q4_k" and row["expert_bytes"] == spec_from_gguf(path).expert_bytes
    assert get_model(str(path)).moe_expert_bytes(0) == spec_from_gguf(path).moe_expert_bytes(0)


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_bad_gguf_is_one_line(tmp_path, run):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(MoesimError, match="not a readable GGUF") as e:
        spec_from_gguf(p)
    assert "\n" not in str(e.value)
    r = run("models", p)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("run", BOTH_WAYS)
def test_whatif_on_a_gguf_file_prints_the_engines_arguments(tmp_path, run):
    """The deployment answer spells llama.cpp's arguments for a model read from a GGUF file
    (its rows name the file's model, which is not a catalogue name: that was a traceback)."""
    (path,) = qwen3moe_gguf(tmp_path / "my model.gguf")  # a space: the printed command quotes it
    r = run("whatif", "--model", path, "--hw", "none", "--host", "ryzen-7950x", "--policy", "all-resident",
            "--engine", "llama.cpp", "--tokens", "4", "--out", tmp_path / "w", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    line = next(ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("llama-server"))
    args = shlex.split(line)  # the user's own file, as the shell reads the line back, not a placeholder
    assert args[:3] == ["llama-server", "-m", str(path)] and "-ngl" in args and args[args.index("-ngl") + 1] == "0"
    notes = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("note") and "--host" in ln]
    assert not notes, notes  # --hw none runs every layer on the host: --host is used
