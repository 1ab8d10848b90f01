"""llama-bench's spelling of the llama.cpp arguments moesim prints (moesim.engine_args.llama_bench_args).

Pure argument translation: no llama.cpp needed (bench/bench_llamacpp.py runs the results through a real
llama-bench)."""

from __future__ import annotations

import re

from moesim.engine_args import cpu_moe_override, invocation, llama_bench_args
from moesim.layout import make_layout
from moesim.models import get_model

MODEL = "qwen3-30b-a3b"


def test_server_spellings_become_llama_bench_ones():
    args = ["llama-server", "-m", "M.gguf", "-ngl", "99", "--cpu-moe", "--split-mode", "row",
            "--tensor-split", "36,12", "-ot", "a=CPU,b=CPU", "-t", "8", "-c", "4096"]
    out, dropped = llama_bench_args(args, 48)
    assert out == ["llama-bench", "-m", "M.gguf", "-ngl", "99", "--n-cpu-moe", "48", "-sm", "row", "-ts", "36/12",
                   "-ot", "a=CPU;b=CPU", "-t", "8"]
    assert len(dropped) == 1 and dropped[0].startswith("-c 4096")


def test_flags_spelled_alike_pass_through():
    args = ["llama-cli", "-m", "M.gguf", "-ngl", "0", "--n-cpu-moe", "3", "-t", "2", "-fa", "1"]
    assert llama_bench_args(args, 4) == (["llama-bench", *args[1:]], [])


def test_invocation_for_llama_bench_has_no_comma_lists_and_no_context():
    spec = get_model(MODEL)
    for layout in (make_layout(spec, 2, cpu_moe_layers=8, ratios=[3, 1]), make_layout(spec, 1, gpu_layers=20),
                   make_layout(spec, 1, cpu_moe_layers=spec.n_moe_layers), make_layout(spec, 0)):
        server = invocation("llama.cpp", spec, layout, threads=8, context=4096)
        bench = invocation("llama.cpp", spec, layout, threads=8, context=4096, program="llama-bench")
        assert bench.args[0] == "llama-bench" and "-c" not in bench.args and "--cpu-moe" not in bench.args
        assert not any("," in a for a in bench.args[1:])  # a comma would make llama-bench run several tests
        assert bench.args[bench.args.index("-ngl") + 1] == server.args[server.args.index("-ngl") + 1]
        if "--cpu-moe" in server.args:
            assert bench.args[bench.args.index("--n-cpu-moe") + 1] == str(spec.n_layers)
        if "--tensor-split" in server.args:
            assert bench.args[bench.args.index("-ts") + 1] == "36/12"


def test_override_pattern_names_the_n_cpu_moe_layers():
    spec = get_model(MODEL)
    layout = make_layout(spec, 1, cpu_moe_layers=3)
    pattern = cpu_moe_override(spec, layout)
    assert pattern == r"blk\.(0|1|2)\.ffn_.*_exps\.=CPU"
    name, buft = pattern.rsplit("=", 1)
    assert buft == "CPU" and re.search(name, "blk.2.ffn_up_exps.weight") and not re.search(name, "blk.3.ffn_up_exps.weight")
    assert not re.search(name, "blk.0.attn_q.weight")
    assert cpu_moe_override(spec, make_layout(spec, 1)) is None
    assert pattern in invocation("llama.cpp", spec, layout).note


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bench_llamacpp", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_parses_a_llama_bench_row_and_strips_the_model():
    bl = _bench_module()
    res = {"rows": [{"threads": 2, "depth": 1024, "n_gen": 32, "tps_mean": 50.0, "tps_std": 2.0, "runs": 3,
                     "samples_tps": [48.0, 50.0, 53.0]}], "others_cpu_frac": 0.01, "loadavg_1m": [0.2, 0.4]}
    model = {"name": "m-2L-q4_k_m", "path": "/x/m-2L-q4_k_m.gguf", "layers": 2, "format": "q4_k_m"}
    row = bl.bench_row(model, res)
    assert (row["file"], row["measured_tok_s"], row["measured_min"], row["measured_max"]) == \
        ("m-2L-q4_k_m.gguf", 50.0, 48.0, 53.0)
    assert row["contended"] is False  # 1% of the CPUs besides its 2 threads, spread 4%
    assert bl._strip_model(["llama-bench", "-m", "f.gguf", "-ngl", "0", "-t", "2"]) == ["-ngl", "0", "-t", "2"]
    spec = get_model(MODEL)
    for _, layout in bl.engine_arg_deployments(spec):
        args = invocation("llama.cpp", spec, layout, threads=2, context=4096, program="llama-bench").args
        assert not any("," in a for a in args) and "-c" not in args
