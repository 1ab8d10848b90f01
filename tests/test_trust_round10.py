"""Issue "What the user sees is true", its input classes: each ends in one line and exit 2
(or a true answer), never a traceback, a hang or a silent wrong answer (docs/robustness.md,
round 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cli_run import ENV, ROOT, in_process, one_line_error
from gguf_files import qwen3moe_gguf


def _gguf(tmp_path, name="m.gguf", **kw):
    return qwen3moe_gguf(tmp_path / name, **kw)[0]


@pytest.mark.parametrize("meta, words", [
    ({"attention.head_count": 0, "attention.key_length": None}, ("head_count is 0", "positive whole number")),
    ({"expert_count": 0}, ("expert_count is 0",)),
    ({"embedding_length": None}, ("no qwen3moe.embedding_length",)),
    ({"block_count": 4_000_000_000}, ("block_count says 4000000000 blocks", "tensors describe 4")),
])
def test_a_gguf_whose_geometry_cannot_be_is_refused_in_one_line(tmp_path, meta, words):
    path = _gguf(tmp_path, meta=meta)
    one_line_error(in_process("models", path), *words)


def test_a_gguf_layer_with_experts_but_no_router_is_refused_not_counted_dense(tmp_path):
    path = _gguf(tmp_path, drop=("blk.2.ffn_gate_inp.weight",))
    one_line_error(in_process("models", path), "layer 2 has expert tensors", "no router")


def test_a_gguf_header_declaring_more_tensors_than_its_bytes_is_refused_before_gguf_py_reads_it(tmp_path):
    path = _gguf(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:16] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    one_line_error(in_process("models", path), "declares 1000000000000 tensors", "more than its")


def test_a_split_gguf_named_part_1_of_0_is_refused(tmp_path):
    path = _gguf(tmp_path, name="m-00001-of-00000.gguf")
    one_line_error(in_process("models", path), "part 1 of 0")


@pytest.mark.parametrize("hw, words", [("none", "names no GPUs"), ("2xa6000", "names 2 GPUs")])
def test_fit_on_a_machine_of_other_than_one_gpu_is_refused(tmp_path, hw, words):
    one_line_error(in_process("fit", tmp_path / "never-read.npz", "--hw", hw), "fit needs one GPU profile", words)


def _moesim(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moesim", *args], env={**os.environ, **ENV}, cwd=ROOT,
                          stderr=subprocess.PIPE, text=True, timeout=120, **kw)


def test_stdout_closed_or_full_ends_in_one_line():
    closed = _moesim("models", stdout=None, pass_fds=(), preexec_fn=lambda: os.close(1))
    one_line_error(closed, "standard output is closed")
    with open("/dev/full", "w") as full:
        r = _moesim("models", stdout=full)
    assert r.returncode == 1 and r.stderr.strip() == "error: could not write the output: No space left on device", \
        r.stderr


@pytest.mark.parametrize("columns", ["0", "-3", "abc", "5"])
def test_a_columns_that_is_no_width_is_ignored_not_an_empty_answer(columns):
    r = in_process("models", env={"COLUMNS": columns})
    assert r.returncode == 0 and "qwen3-30b-a3b" in r.stdout, r.stderr


@pytest.mark.parametrize("fmt, arrays, words", [
    ("npz", {"experts": np.zeros((4, 2, 2), np.int64), "gate": np.ones((4, 2, 2), np.float32)},
     ("unknown array 'gate'", "did you mean 'gates'?")),
    ("vllm", {"routed_experts": np.zeros((6, 2, 2), np.int64), "prompt_tokens": 2, "tokenids": np.zeros(4, np.int64)},
     ("unknown array 'tokenids'", "did you mean 'token_ids'?")),
])
def test_a_misspelt_npz_member_is_refused_not_silently_left_out(tmp_path, fmt, arrays, words):
    np.savez(tmp_path / "r.npz", **arrays)
    one_line_error(in_process("import", fmt, tmp_path / "r.npz", "--model", "tiny", "--out", tmp_path / "t.npz"), *words)
    assert not (tmp_path / "t.npz").exists()


def test_an_engine_fraction_above_one_is_refused(tmp_path):
    from moesim.engines import builtin_engines

    text = builtin_engines()["llama.cpp"].read_text()
    bad = tmp_path / "e.toml"
    assert "\ndefault = { value = 0." in text  # [cpu_weight_efficiency]'s (a fitted figure: its digits change)
    bad.write_text(text.replace("\ndefault = { value = 0.", "\ndefault = { value = 50.", 1))
    one_line_error(in_process("hw", bad, "--engines"), "'default'", "a fraction (at most 1), got 50.")


def test_two_quantisations_of_one_model_in_one_sweep_each_keep_their_rows(tmp_path):
    from gguf_files import T

    a = _gguf(tmp_path, "m-Q4_K.gguf")
    b = _gguf(tmp_path, "m-Q8_0.gguf", gate_types=[T.Q8_0] * 4, down_types=[T.Q8_0] * 4)
    r = in_process("whatif", "--model", f"{a},{b}", "--hw", "a6000", "--policy", "on-demand", "--cache-gib", "0",
                   "--tokens", "8", "--jobs", "1", "--json", "--out", tmp_path / "w", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert sorted(row["model"] for row in rows) == ["synthetic-qwen3moe (m-Q4_K.gguf)",
                                                     "synthetic-qwen3moe (m-Q8_0.gguf)"]
    by = {row["model"]: row for row in rows}
    assert by["synthetic-qwen3moe (m-Q8_0.gguf)"]["copy_ms"] > by["synthetic-qwen3moe (m-Q4_K.gguf)"]["copy_ms"]


def test_two_host_profiles_with_one_name_in_one_sweep_are_refused(tmp_path):
    from moesim.hardware import builtin_hosts

    src = builtin_hosts()["epyc-9654"].read_text()
    (tmp_path / "h.toml").write_text(src.replace("figures.", "figures.", 1))
    r = in_process("whatif", "--model", "tiny", "--hw", "a6000", "--host", f"epyc-9654,{tmp_path / 'h.toml'}",
                   "--policy", "cpu-static", "--tokens", "8", "--jobs", "1", "--out", tmp_path / "w", cwd=tmp_path)
    one_line_error(r, "--host", "both named 'epyc-9654'")


def test_copy_policies_hold_every_expert_in_host_ram_so_a_small_host_ram_does_not_fit(tmp_path):
    """qwen3-30b-a3b's routed experts are about 58 GB in bf16: 8 GB of RAM cannot hold them, 200 GB can."""
    def rows(ram):
        r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--policy", "on-demand",
                       "--cache-gib", "0", "--host-ram-gb", ram, "--tokens", "8", "--jobs", "1", "--json",
                       "--out", tmp_path / f"w{ram}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["rows"]

    small, = rows("8")
    assert small["fits"] is False and small["bound"] == "memory" and "8 GB of RAM" in small["note"], small
    large, = rows("200")
    assert large["fits"] is True and large["tpot_ms"] > 0, large


@pytest.mark.parametrize("edited", ["host", "engine"])
def test_resumed_rows_are_refused_once_a_profile_file_they_depend_on_was_edited(tmp_path, edited):
    from moesim.engines import builtin_engines
    from moesim.hardware import builtin_hosts

    host, engine = tmp_path / "h.toml", tmp_path / "e.toml"
    host.write_text(builtin_hosts()["epyc-9654"].read_text().replace('name = "epyc-9654"', 'name = "mine"'))
    engine.write_text(builtin_engines()["llama.cpp"].read_text().replace('name = "llama.cpp"', 'name = "mine"'))
    args = ("whatif", "--model", "tiny", "--hw", "a6000", "--host", host, "--engine", engine, "--policy",
            "cpu-static", "--cpu-layers", "2", "--tokens", "8", "--jobs", "1", "--rows", tmp_path / "r.csv",
            "--out", tmp_path / "w")
    first = in_process(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = in_process(*args, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    f = host if edited == "host" else engine
    text = f.read_text()
    assert "{ value = " in text
    f.write_text(text.replace("{ value = ", "{ value = 1", 1))  # one figure, now larger
    one_line_error(in_process(*args, cwd=tmp_path), "holds a different sweep", "profile file edited")


@pytest.mark.parametrize("command", [
    ("import", "npz", ROOT / "traces/examples/routing-moe-stdlib.npz", "--model", "moe-stdlib"),
    ("fit", "never-read.npz"),
    ("record", "moe-stdlib", "--tokens", "2"),
])
def test_import_record_and_fit_refuse_an_out_another_run_is_writing(tmp_path, command):
    out = tmp_path / ("p.toml" if command[0] == "fit" else "t.npz")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom moesim.atomic import exclusive\n"
                               f"with exclusive({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
                              env={**os.environ, **ENV}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        one_line_error(in_process(*command, "--out", out, cwd=tmp_path), "is in use by another moesim run")
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


def test_a_gpu_layers_count_past_the_model_is_refused_before_the_sweep(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "a6000", "--policy", "gpu-layers", "--gpu-layers",
                   "1000", "--tokens", "8", "--jobs", "1", "--out", tmp_path / "w", cwd=tmp_path)
    one_line_error(r, "--gpu-layers 1000", "has 48 layers")
    assert not (tmp_path / "w").exists()


def test_synth_like_a_trace_without_predictions_makes_none_rather_than_always_wrong_ones(tmp_path):
    from moesim.sim.stats import synth_like
    from moesim.traces.format import read_trace

    imported = tmp_path / "imp.npz"
    r = in_process("import", "npz", ROOT / "traces/examples/routing-moe-stdlib.npz", "--model", "moe-stdlib",
                   "--out", imported)
    assert r.returncode == 0, r.stderr
    r = in_process("synth", "--like", imported, "--tokens", "16", "--out", tmp_path / "like.npz")  # streamed
    assert r.returncode == 0, r.stderr
    with np.load(tmp_path / "like.npz") as z:
        assert (z["pred_ids"] == -1).all() and (z["true_ids"] >= 0).all()
    stats = in_process("stats", tmp_path / "like.npz")
    assert stats.returncode == 0 and "predictor" not in stats.stdout, stats.stdout
    in_memory = synth_like(read_trace(imported), 16)  # the path whatif's synthetic traces take
    assert (in_memory.pred_ids == -1).all()


@pytest.mark.parametrize("skip, formats", [
    ([], ("fp8-block128", "fp8-block128")),
    (["lm_head", "model.layers.0.mlp.gate"], ("fp8-block128", "fp8-block128")),  # a router: still fp8
    (["self_attn"], ("fp8-block128", "bf16")),
    (["re:.*experts.*", "self_attn"], ("bf16", "bf16")),
])
def test_fp8_modules_to_not_convert_keep_the_models_dtype(tmp_path, skip, formats):
    from moesim.artefacts import formats_from_config

    raw = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                               "modules_to_not_convert": skip}}
    assert formats_from_config(raw, tmp_path / "config.json")[:2] == formats


@pytest.mark.parametrize("hw", ["2xrtx3090", "rtx5090+rtx3090", "3xrtx3090"])
def test_the_printed_llama_cpp_split_is_the_timed_deployments(tmp_path, hw):
    """The arguments' --tensor-split, -ngl and --n-cpu-moe, read back as llama.cpp reads them
    (layers in proportion to the shares), hold on each GPU exactly the bytes the row was timed
    with: the plan's split, not an even one (which put 31.6 GB on a 24 GB card)."""
    from moesim.hardware import get_machine
    from moesim.layout import make_layout
    from moesim.memory import layout_bytes
    from moesim.models import get_model

    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", hw, "--engine", "llama.cpp", "--policy",
                   "cpu-static,gpu-layers", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec, checked = get_model("qwen3-30b-a3b"), 0
    mem = get_machine(hw).device_memory_gb()
    for fam in json.loads(r.stdout)["deployment"][0]["families"]:
        inv, row = fam.get("invocation"), fam.get("row")
        if not inv or not row["fits"]:
            continue
        a = inv["args"]
        shares = [float(x) for x in a[a.index("--tensor-split") + 1].split(",")]
        ngl = int(a[a.index("-ngl") + 1])
        cpu_moe = int(a[a.index("--n-cpu-moe") + 1]) if "--n-cpu-moe" in a else 0
        assert len(shares) == len(mem), a
        layout = make_layout(spec, len(mem), gpu_layers=min(ngl, spec.n_layers), cpu_moe_layers=cpu_moe, ratios=shares)
        gpu = layout_bytes(spec, layout, 1, 136).gpu
        assert max(gpu) / 1e9 == pytest.approx(row["device_gb_needed"], rel=1e-9), (a, gpu)
        assert all(b <= m * 1e9 for b, m in zip(gpu, mem)), (a, gpu, mem)
        checked += 1
    assert checked >= 1


def test_the_breakdown_chart_draws_each_rows_tpot_and_marks_what_does_not_fit(tmp_path, monkeypatch):
    """Each bar is its row's TPOT (GPU, CPU, copies and transfers stacked), CPU families
    included (gpu-layers was drawn at its GPU time alone: 2.5 ms of a 51.3 ms TPOT); an
    unfit row is hatched; what is not drawn is named in the caption."""
    from matplotlib.patches import Rectangle

    from moesim.reports import render

    figs = []
    real = render.save_figure
    monkeypatch.setattr(render, "save_figure", lambda fig, path: (figs.append((fig, path.name)), real(fig, path))[1])
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090,2xrtx3090", "--host", "epyc-9654",
                   "--tokens", "8", "--jobs", "1", "--out", tmp_path / "w", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    fig = next(f for f, name in figs if name == "breakdown.png")
    ax = fig.axes[0]
    heights: dict[int, float] = {}
    hatched: dict[int, bool] = {}
    for p in ax.patches:
        if isinstance(p, Rectangle) and p.get_width() < 1:
            i = round(p.get_x() + p.get_width() / 2)
            heights[i] = heights.get(i, 0.0) + p.get_height()
            hatched[i] = hatched.get(i, False) or bool(p.get_hatch())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) == len(heights) >= 8
    for i, label in enumerate(labels):
        hw, policy = label.split("\n")
        mine = [x for x in rows if x["hw"] == hw and x["policy"] == policy and x["tpot_ms"] is not None]
        fitting = [x for x in mine if x["fits"]]
        best = min(fitting or mine, key=lambda x: x["tpot_ms"])
        assert heights[i] == pytest.approx(best["tpot_ms"], rel=1e-9), label
        assert hatched[i] == (not best["fits"]), label
    assert any(x["policy"] == "gpu-layers" and x["cpu_ms"] > 1 for x in rows)  # a CPU family is among the bars
    caption = (tmp_path / "w" / "report.html").read_text()
    assert "not drawn, as they did not run on the machine: " in caption and "hot-experts on 2xrtx3090" in caption
    assert "None engine" not in caption and "pytorch-eager engine" in caption


@pytest.mark.parametrize("policy, words", [("gpu-layers", "CPU-bound: "), ("cpu-static", "CPU-bound: "),
                                           ("all-resident", "compute-bound: no expert copies")])
def test_replays_bound_sentence_names_the_part_that_dominates_its_tpot(tmp_path, policy, words):
    trace = tmp_path / "q.npz"
    assert in_process("synth", "--model", "qwen3-30b-a3b", "--tokens", "8", "--out", trace).returncode == 0
    r = in_process("replay", trace, "--hw", "rtx4090", "--host", "epyc-9654", "--policy", policy, "--json")
    assert r.returncode == 0, r.stderr
    from moesim.sim.analysis import tpot_parts, why

    row, = json.loads(r.stdout)["rows"] if isinstance(json.loads(r.stdout), dict) else json.loads(r.stdout)
    assert sum(tpot_parts(row).values()) == pytest.approx(row["tpot_ms"], rel=1e-12)
    assert why(row).startswith(words), why(row)
    assert row["serial_bound_ms"] >= row["tpot_ms"] - 1e-9 >= row["overlap_bound_ms"] - 2e-9


def test_the_whatif_table_shows_the_swept_knob_and_ecospec_every_selection(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--host", "epyc-9654", "--policy",
                   "cpu-static", "--cpu-layers", "8,16,32", "--tokens", "8", "--jobs", "1", cwd=tmp_path,
                   env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    for n in (8, 16, 32):
        assert f"{n} MoE layers on CPU, bf16" in r.stdout, r.stdout
    r = in_process("ecospec", "--model", "qwen3-235b-a22b", "--deployment", "8xh200-tp,1xh200-offload", "--gamma",
                   "2", "--steps", "8", "--selection", "ecospec,confidence,ecospec:lagrangian:0.5", cwd=tmp_path,
                   env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if "qwen3-235b-a22b" in ln and "│" in ln]
    assert len(rows) == 6 and sum("lagrangian 0.5" in ln for ln in rows) == 2, r.stdout


def test_the_help_uses_the_engines_own_words():
    for command, words in (("whatif", ("--n-cpu-moe", "-ngl", "--kt-num-gpu-experts", "--cpu-offload-gb")),
                           ("replay", ("--n-cpu-moe", "-ngl"))):
        r = in_process(command, "--help", env={"COLUMNS": "400"})
        text = " ".join(r.stdout.split())
        for w in words:
            assert w in text, (command, w)


def test_a_plan_in_another_format_than_the_gguf_says_so_instead_of_loading_that_file(tmp_path):
    path = _gguf(tmp_path, "m-Q4_K.gguf")

    def command(*extra):
        r = in_process("whatif", "--model", path, "--hw", "a6000", "--engine", "llama.cpp", "--policy",
                       "all-resident", "--tokens", "8", "--jobs", "1", "--json", *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        fam = next(f for f in json.loads(r.stdout)["deployment"][0]["families"] if f["family"] == "all-resident")
        return fam["invocation"]

    same = command()
    assert str(path) in same["args"] and "placeholder" not in same["note"]
    other = command("--expert-dtype", "bf16")
    assert str(path) not in other["args"], other
    assert "the plan's experts are bf16, and m-Q4_K.gguf holds q4_k" in other["note"], other


@pytest.mark.parametrize("split,shares", [("layer", "3,1"), ("tensor", None)])
def test_whatif_takes_the_split_options_replay_takes_and_prints_that_split(tmp_path, split, shares):
    """`whatif --hw 2xrtx3090 --tensor-split 3,1` (the README shows the options beside a multi-GPU
    --hw) was refused as an unknown option; now the timed layout is the one asked for, the rows
    say it, and the printed llama.cpp arguments spell it (read back, the same bytes per GPU)."""
    from moesim.layout import make_layout
    from moesim.memory import layout_bytes
    from moesim.models import get_model

    extra = ["--split", split] + (["--tensor-split", shares] if shares else [])
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "2xrtx3090", "--host", "epyc-7742", "--engine",
                   "llama.cpp", "--policy", "cpu-static", "--cpu-layers", "30", "--tokens", "8", "--jobs", "1",
                   "--json", *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    row = next(x for x in out["rows"] if x["policy"] == "cpu-static")
    assert row["split"] == split and row["tensor_split"] == (shares or "-")
    a = next(f["invocation"]["args"] for f in out["deployment"][0]["families"] if f.get("invocation"))
    assert ("--split-mode" in a) == (split == "tensor")
    if split == "layer":
        got = [float(x) for x in a[a.index("--tensor-split") + 1].split(",")]
        assert got[0] == 3 * got[1]  # 3:1 of the 48 layers: 36,12
        spec = get_model("qwen3-30b-a3b")
        layout = make_layout(spec, 2, cpu_moe_layers=30, ratios=got)
        assert max(layout_bytes(spec, layout, 1, 136).gpu) / 1e9 == pytest.approx(row["device_gb_needed"], rel=1e-9)
    plain = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "2xrtx3090", "--host", "epyc-7742", "--engine",
                       "llama.cpp", "--policy", "cpu-static", "--cpu-layers", "30", "--tokens", "8", "--jobs", "1",
                       "--json", cwd=tmp_path)
    other = next(x for x in json.loads(plain.stdout)["rows"] if x["policy"] == "cpu-static")
    # The split is planned, not only printed: 3:1 loads the first card more than the byte cut;
    # a tensor split shards every layer (two all-reduces a layer: another TPOT). Two alike
    # GPUs running whole layers one after the other take the same time however they are cut.
    changed = "tpot_ms" if split == "tensor" else "device_gb_needed"
    assert other[changed] != row[changed]


@pytest.mark.parametrize("extra,message", [
    (["--tensor-split", "1,1,1"], "3 shares for 2 GPUs"), (["--tensor-split", "1,-1"], "shares from 0 to"),
    (["--tensor-split", "nan,1"], "shares from 0 to"), (["--split", "rows"], "--split 'rows'")])
def test_whatif_refuses_a_bad_split_before_any_work(tmp_path, extra, message):
    r = in_process("whatif", "--hw", "2xrtx3090", "--tokens", "8", "--jobs", "1", *extra, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_whatif_says_when_a_split_changed_nothing(tmp_path):
    r = in_process("whatif", "--hw", "a6000", "--policy", "all-resident", "--model", "olmoe-1b-7b",
                   "--tensor-split", "1,1", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any("--tensor-split" in n and "changed nothing" in n for n in json.loads(r.stdout)["notes"]), r.stdout


def test_a_split_over_one_and_several_gpu_machines_applies_where_there_are_several(tmp_path):
    """`--hw a6000,2xrtx3090 --tensor-split 1,3` failed 4 of 5 groups ("2 shares for 1 GPUs"):
    the shares are the two-GPU machine's; the one-GPU rows say `-` and print no split."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000,2xrtx3090", "--host", "epyc-7742", "--engine",
                   "llama.cpp", "--policy", "cpu-static,all-resident", "--tensor-split", "1,3", "--tokens", "4",
                   "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {(x["hw"], x["split"], x["tensor_split"]) for x in out["rows"]} == {("a6000", "-", "-"),
                                                                              ("2xrtx3090", "layer", "1,3")}
    args = [" ".join(f["invocation"]["args"]) for d in out["deployment"] for f in d["families"] if f.get("invocation")]
    assert any("--tensor-split 4,12" in a for a in args) and any("--tensor-split" not in a for a in args)


def test_replay_without_a_gpu_writes_its_report(tmp_path):
    """`replay --hw none --host H --out DIR` printed its table, wrote half a report, then failed
    with "name the host" (exit 2): the report's timeline re-ran a static layout without the host."""
    r = in_process("synth", "--model", "olmoe-1b-7b", "--tokens", "4", "--out", "t.npz", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = in_process("replay", "t.npz", "--hw", "none", "--host", "ryzen-9950x", "--policy", "all-resident", "--out",
                   "rp", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rp" / "report.html").exists() and "No timeline" in (tmp_path / "rp" / "report.html").read_text()


def test_a_value_a_row_does_not_have_is_a_dash_in_the_table_not_none(tmp_path):
    """All-resident rows have no CPU time (None in --json): the table printed the word None."""
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "epyc-7742", "--policy",
                   "all-resident,cpu-static", "--tokens", "4", "--jobs", "1", cwd=tmp_path, env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("\n\n")[0]
    assert "CPU ms" in table and "None" not in table and " - │" in table, table


@pytest.mark.parametrize("command", ["whatif", "replay"])
def test_threads_above_the_cores_are_said_to_change_nothing(tmp_path, command):
    """`--threads 100` on a 64-core host was timed as 64 threads without a word."""
    if command == "replay":
        assert in_process("synth", "--model", "olmoe-1b-7b", "--tokens", "4", "--out", "t.npz",
                          cwd=tmp_path).returncode == 0
    head = ["whatif", "--model", "olmoe-1b-7b", "--tokens", "4", "--jobs", "1"] if command == "whatif" else ["replay",
                                                                                                          "t.npz"]
    rows = {}
    for threads in ("64", "100"):
        r = in_process(*head, "--hw", "a6000", "--host", "epyc-7742", "--policy", "cpu-static", "--threads", threads,
                       "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        rows[threads] = [x["tpot_ms"] for x in (out["rows"] if command == "whatif" else out)]
        notes = " ".join(out.get("notes") or [out.get("note") or ""]) if command == "whatif" else r.stderr
        assert ("--threads 100 is above epyc-7742's 64 cores: timed as 64 threads" in notes) == (threads == "100"), notes
    assert rows["64"] == rows["100"]  # the note is true: the same answer


def test_a_second_socket_the_engine_does_not_read_is_said(tmp_path):
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", "epyc-7742@2s", "--policy",
                   "cpu-static", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any("2 sockets, but pytorch-eager reads the experts from one socket's memory" in n
               for n in json.loads(r.stdout)["notes"]), r.stdout


def test_a_host_file_whose_name_holds_an_at_sign(tmp_path):
    """`--host my@host.toml` was read as the variant `host.toml` of a host `my`."""
    one_line_error(in_process("whatif", "--host", "my@host.toml", cwd=tmp_path),
                   "host profile file my@host.toml does not exist")
    (tmp_path / "my@host.toml").write_text((ROOT / "hwprofiles" / "hosts" / "epyc-7742.toml").read_text())
    for host in ("my@host.toml", "my@host.toml@2x3200"):
        r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "a6000", "--host", host, "--policy", "cpu-static",
                       "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert {x["host"] for x in json.loads(r.stdout)["rows"]} == {"epyc-7742" + host[len("my@host.toml"):]}


def test_a_host_ram_beyond_the_range_names_the_range(tmp_path):
    one_line_error(in_process("whatif", "--host-ram-gb", "1e308", "--tokens", "4", cwd=tmp_path),
                   "above 0 and below 10,000,000")


@pytest.mark.parametrize("quant, words", [
    ({"modules_to_not_convert": "self_attn"}, ("modules_to_not_convert is 'self_attn'", "a list of module names")),
    ({"modules_to_not_convert": ["re:("]}, ("pattern 're:(' is not a regular expression",)),
    ({"modules_to_not_convert": [3]}, ("a list of module names",)),
])
def test_a_skip_list_that_is_no_list_of_names_is_refused(tmp_path, quant, words):
    """A string was read a letter at a time (its 's' matched the experts: sized bf16, not fp8);
    a pattern that is no regular expression was a re.error traceback (stranger round 12)."""
    from moesim.artefacts import formats_from_config
    from moesim.errors import MoesimError

    raw = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                               **quant}}
    with pytest.raises(MoesimError) as e:
        formats_from_config(raw, tmp_path / "config.json")
    assert all(w in str(e.value) for w in words), e.value


@pytest.mark.parametrize("dtype", ["", ["bfloat16"], 16])
def test_a_dtype_that_is_no_dtype_is_refused_not_read_as_absent(tmp_path, dtype):
    """`"torch_dtype": ""` ran as bf16 (an empty string read as no dtype); a list was a TypeError."""
    from moesim.artefacts import formats_from_config
    from moesim.errors import MoesimError

    with pytest.raises(MoesimError, match="not supported"):
        formats_from_config({"torch_dtype": dtype}, tmp_path / "config.json")


@pytest.mark.parametrize("kw, words", [
    ({"meta": {"block_count": 3}}, ("block_count says 3 blocks", "tensors describe 4 (up to blk.3)")),
    ({"meta": {"expert_feed_forward_length": 0}}, ("expert_feed_forward_length is 0", "positive whole number")),
    ({"drop": ("blk.1.ffn_up_exps.weight",)}, ("layer 1 has no blk.1.ffn_up_exps.weight",)),
])
def test_a_gguf_whose_tensors_the_metadata_does_not_cover_is_refused(tmp_path, kw, words):
    """Fewer blocks than the tensors describe, an expert width of 0 (read as absent: the dense
    width was used) and a MoE layer short of one expert tensor: each lost bytes silently."""
    one_line_error(in_process("models", _gguf(tmp_path, **kw)), *words)


def test_two_files_of_one_name_in_two_folders_are_both_swept(tmp_path):
    """`--model m-Q4_K.gguf,sub/m-Q4_K.gguf` (other quantisations, one file name): one was dropped."""
    from gguf import GGMLQuantizationType as T

    a = qwen3moe_gguf(tmp_path / "m-Q4_K.gguf")[0]
    (tmp_path / "sub").mkdir()
    qwen3moe_gguf(tmp_path / "sub" / "m-Q4_K.gguf", gate_types=[T.Q8_0] * 4, down_types=[T.Q8_0] * 4)
    r = in_process("whatif", "--model", f"{a.name},sub/{a.name}", "--hw", "a6000", "--policy", "on-demand",
                   "--cache-gib", "0", "--tokens", "4", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    models = {x["model"] for x in json.loads(r.stdout)["rows"]}
    assert len(models) == 2 and any("(sub/m-Q4_K.gguf)" in m for m in models), models
