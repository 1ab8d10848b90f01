"""Trust, round 14 (issue 52, items 3-8): numbers in range and printed without exponents, one
value however spelled, a user's engine file as the user's, messages that say what is wrong,
names with a way forward, the printed context, progress on long commands. Library-level and
fast; the real CLI runs are tests/stranger/cases_round14.py."""

from __future__ import annotations

import io
import re

import pytest

from moesim import bounds, fmt
from moesim.errors import MoesimError
from moesim.hardware import get_host, get_machine


@pytest.mark.parametrize("v,want", [(9.83e-05, "0.0000983"), (1.102e4, "11,020"), (12.3, "12.3"), (0.0412, "0.0412"),
                                    (9.999, "10"), (5, "5"), (1.234e20, "123,000,000,000,000,000,000"),
                                    (-0.00012345, "-0.000123"), (1e-300, "<0.000000000001"), (0, "0")])
def test_numbers_print_without_exponents(v, want):
    assert fmt.number(v) == want
    assert "e" not in fmt.number(v).lower()


@pytest.mark.parametrize("call", [lambda: bounds.check_rate(1e-9), lambda: bounds.check_rate(1e308),
                                  lambda: bounds.check_rate(float("nan")), lambda: bounds.check_size(1e308, "--cache-gib"),
                                  lambda: bounds.check_size(-1, "--cache-gib"), lambda: bounds.check_shares([1e308, 1e308]),
                                  lambda: bounds.check_shares([0, 0]), lambda: bounds.check_shares([1e7, 1]),
                                  lambda: bounds.check_count(-5, "--gpu-layers", auto=True)])
def test_out_of_range_numbers_are_one_line_without_exponents(call):
    with pytest.raises(MoesimError) as e:
        call()
    assert not re.search(r"\de[+-]\d", str(e.value)) and len(str(e.value)) < 200, str(e.value)


def test_in_range_edges_pass():
    assert bounds.check_rate(0.001) == 0.001 and bounds.check_size(1e12, "--cache-gib") == 1e12
    assert bounds.check_shares([1e6, 0]) == [1e6, 0] and bounds.check_count("auto", "--gpu-layers", auto=True) == "auto"


def test_replay_and_whatif_share_one_validation():
    from moesim.sim.replay import check_given, replay_setting

    for knobs, word in (({"threads": 0}, "--threads"), ({"gpu_layers": -5}, "--gpu-layers"),
                        ({"link_gbps": 1e-9}, "--link-gbps"), ({"ratios": [1e308, 1e308]}, "--tensor-split")):
        with pytest.raises(MoesimError, match=word):
            check_given(replay_setting(**knobs))


def test_host_variants_are_named_by_their_value():
    assert get_host("epyc-9654@02x4800.0").name == get_host("epyc-9654@2x4800").name == "epyc-9654@2x4800"
    assert get_host("epyc-9654@2s@12x4800").name == get_host("epyc-9654@12x4800@02s").name
    with pytest.raises(MoesimError, match="name the host before @"):
        get_host("@2x4800")


def test_machines_are_compared_by_their_gpus():
    from moesim.sim.whatif import check_unique_names, value_of

    assert get_machine("2Xrtx3090").name == "2xrtx3090"
    assert value_of(get_machine("2xrtx3090")) == value_of(get_machine("rtx3090+rtx3090"))
    with pytest.raises(MoesimError, match="the same machine"):
        check_unique_names(["2xrtx3090", "rtx3090+rtx3090"], [get_machine("2xrtx3090"), get_machine("rtx3090+rtx3090")])
    hosts = ["epyc-9654@2x4800", "epyc-9654@2x4800.0"]
    with pytest.raises(MoesimError, match="the same host"):
        check_unique_names(hosts, [get_host(h) for h in hosts], "--host")
    check_unique_names(["2xrtx3090", "rtx3090+rtx4090"], [get_machine("2xrtx3090"), get_machine("rtx3090+rtx4090")])


def test_a_users_engine_file_is_the_users(tmp_path):
    from moesim.engines import builtin_engines, get_engine

    text = builtin_engines()["llama.cpp"].read_text()
    (tmp_path / "vl.toml").write_text(re.sub(r"^name = .*$", 'name = "vllm"', text, count=1, flags=re.M))
    e = get_engine(str(tmp_path / "vl.toml"))
    assert e.name == "vllm (vl.toml, a user's file)" and e.runs_as == ""
    top, _, rest = text.partition("\n[")
    (tmp_path / "my.toml").write_text(f'{top}\nruns_as = "llama.cpp"\n[{rest}'.replace('"llama.cpp"', '"my-llama.cpp"', 1))
    e = get_engine(str(tmp_path / "my.toml"))
    assert e.name == "my-llama.cpp" and e.runs_as == "llama.cpp"
    assert get_engine("llama.cpp").runs_as == "llama.cpp"
    assert get_engine(str(builtin_engines()["vllm"])).name == "vllm"  # the built-in file itself is the built-in
    (tmp_path / "bad.toml").write_text(f'{top}\nruns_as = "nope"\n[{rest}')
    with pytest.raises(MoesimError, match="runs_as 'nope'"):
        get_engine(str(tmp_path / "bad.toml"))


def test_aliases_and_nearest_names():
    from moesim.models import get_model

    assert get_model("deepseek-r1").name == get_model("DeepSeek-R1-0528").name == "deepseek-v3"
    with pytest.raises(MoesimError, match="nearest: 'epyc-7343'"):
        get_host("epyc-7302")
    with pytest.raises(MoesimError, match="nearest: 'qwen3-30b-a3b'"):
        get_model("qwen3-30b-a3")
    assert fmt.nearest_hint("zzzzzz", ["a6000"]) == ""


def test_progress_lines_where_stderr_is_no_terminal(monkeypatch):
    from moesim.cli import running

    buf = io.StringIO()
    monkeypatch.setattr(running.err, "_file", buf)  # rich reads sys.stderr anew while _file is None: restored so
    with running.progress_bar("leave one source out", "sources", lines=True) as update:
        for i in range(1, 40):
            update(i, 39)
    lines = buf.getvalue().splitlines()
    assert 2 <= len(lines) <= 11 and lines[-1].startswith("leave one source out: 39 of 39 sources"), lines


def test_ktransformers_lines_are_one_program_each():
    """The hot-experts line appended the SGLang integration's --kt-num-gpu-experts to
    ktransformers.local_chat: one program of one engine a line now."""
    from moesim.engine_args import ktransformers
    from moesim.layout import make_layout
    from moesim.models import get_model

    spec = get_model("qwen3-30b-a3b")
    hot = ktransformers(spec, make_layout(spec, 1), threads=32, gpu_experts_per_layer=45)
    assert hot.args[:3] == ["python", "-m", "sglang.launch_server"] and not hot.files
    assert all(a.startswith("--kt-") or not a.startswith("--") or a == "--model" for a in hot.args)
    assert hot.args[hot.args.index("--kt-num-gpu-experts") + 1] == "45"
    static = ktransformers(spec, make_layout(spec, 1, cpu_moe_layers=4), threads=32, tokens=8)
    assert static.args[:3] == ["python", "-m", "ktransformers.local_chat"] and "moesim-rule.yaml" in static.files
    assert not any(a.startswith("--kt-") for a in static.args)


def test_validate_published_stops_at_the_first_ctrl_c(tmp_path):
    """The stranger run: the first SIGINT only asked the loop to stop and nothing asked, so the
    scoring ran on for minutes; now it ends at the next source, one line, exit 130."""
    import signal

    from cli_signals import signal_when

    rc, err = signal_when(["validate", "--published"], lambda s: "leave one source out" in s, signal.SIGINT,
                          cwd=tmp_path, wait_s=60)
    lines = [x for x in err.splitlines() if x.strip() and "leave one source out" not in x]
    assert rc == 130 and lines[-1].strip() == "interrupted (Ctrl-C)", err[-2000:]
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_an_engine_file_that_runs_as_pytorch_eager_says_why_no_command_is_printed(tmp_path):
    """The stranger run: runs_as = "pytorch-eager" was accepted and then nothing was printed."""
    from cli_run import in_process

    figs = "".join(f'{k} = {{ value = {v}, kind = "estimate", source = "x" }}\n' for k, v in
                   (("attention_kernels", 20), ("expert_kernels", 6), ("fused_experts", 1), ("head_kernels", 4),
                    ("predict_kernels", 3)))
    (tmp_path / "mine.toml").write_text(f'name = "mine"\nruns_as = "pytorch-eager"\nruns_on = ["gpu", "cpu"]\n'
                                        f"[figures]\n{figs}")
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "rtx4090", "--engine",
                   str(tmp_path / "mine.toml"), "--tokens", "4", "--jobs", "1", "--out", str(tmp_path / "w"),
                   cwd=tmp_path, env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "all-resident with mine: no command: pytorch-eager is moesim's own reference executor" in " ".join(r.stdout.split())
