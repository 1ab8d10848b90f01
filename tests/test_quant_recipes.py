"""A llama.cpp file type named by the user prices the file llama-quantize would write
(moesim.quant_recipes): the plain types quantise every matrix, rows no block divides take
llama-quantize's fallback, and a file that reads more bytes is never the faster CPU step."""

from __future__ import annotations

import pytest

from moesim.models import get_model, matrix_bytes
from moesim.quant_recipes import RECIPES, store_as, stored_type
from moesim.setting import Setting
from moesim.sim.static import simulate_static
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


@pytest.mark.parametrize("ftype", ["q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q8_0"])
def test_a_plain_file_type_quantises_the_whole_file(ftype):
    s = store_as(get_model("deepseek-v2-lite"), ftype)
    assert s.expert_dtype == ftype and s.dense_dtype == ftype
    assert s.head_dtype == ("q8_0" if ftype == "q8_0" else "q6_k")  # llama_tensor_get_type_impl's output rule


def test_rows_no_block_divides_take_llama_quantizes_fallback():
    # src/llama-quant.cpp tensor_type_fallback: Q4_K -> Q5_0, Q6_K -> Q8_0, 256-block i-quants -> IQ4_NL
    assert stored_type("q4_k", 1408) == "q5_0" and stored_type("q6_k", 1408) == "q8_0"
    assert stored_type("iq1_s", 2880) == "iq4_nl" and stored_type("q2_k", 1408) == "q4_0"
    assert stored_type("q4_k", 2048) == "q4_k"
    assert stored_type("q6_k", 2880, output=True) == "q8_0"
    assert stored_type("q4_0", 100) == "fp16"  # no 32-block fits either: F16
    s = store_as(get_model("deepseek-v2-lite"), "q4_k_m")  # 1,408-wide experts: refused before
    h, i = s.hidden, s.expert_inter
    first = 2 * matrix_bytes(i, h, "q4_k") + matrix_bytes(h, i, "q8_0")  # layer 1 uses more bits: Q6_K -> Q8_0
    assert s.expert_bytes_by_layer[0] == first
    assert s.dense_dtype == "q5_0"  # the dense FFN's 10,944-wide down falls back; one format holds the dense part


def _cpu_tpot(spec) -> float:
    trace = synthetic_trace(spec, SyntheticParams(tokens=4, prompt_len=128, seed=0))
    res = simulate_static(trace, "none", "all-resident", Setting(host="ryzen-7950x", engine="llama.cpp", threads=16))
    return float(res.tpot.mean())


def test_more_bytes_is_never_a_faster_cpu_step():
    base = get_model("deepseek-v2-lite")
    by_size = sorted(["q4_0", "q5_0", "q8_0", "q4_k_m", "q6_k"], key=lambda f: store_as(base, f).bytes_per_token())
    times = [_cpu_tpot(store_as(base, f)) for f in by_size]
    assert times == sorted(times), dict(zip(by_size, times))


def test_every_recipe_names_known_formats():
    from moesim.models import DTYPES

    assert all(t in DTYPES for recipe in RECIPES.values() for t in recipe)


def test_gpt_oss_native_gguf_is_mxfp4_moe():
    """llama-quantize's MXFP4_MOE (src/llama-quant.cpp): MoE tensors MXFP4, every other tensor
    and the output Q8_0; moesim priced the native file's attention and head as bf16 (3.7 GB a
    token for gpt-oss-20b where the file reads about 1.9)."""
    native, gguf = get_model("gpt-oss-20b"), store_as(get_model("gpt-oss-20b"), "mxfp4_moe")
    assert (gguf.expert_dtype, gguf.dense_dtype, gguf.head_dtype) == ("mxfp4-gguf", "q8_0", "q8_0")
    assert gguf.expert_bytes == native.expert_bytes  # the same 4.25 bits a weight
    assert gguf.lm_head_bytes < 0.6 * native.lm_head_bytes
    assert _cpu_tpot(gguf) < 0.75 * _cpu_tpot(native)
