from pathlib import Path

import pytest

from moesim.errors import MoesimError
from moesim.hardware import builtin_profiles, get_profile, load_profile

REQUIRED = {"a6000", "a100-pcie", "h100-sxm", "h100-pcie", "h200", "gh200", "rtx4090", "l40s"}


def test_every_builtin_profile_loads_and_says_where_its_figures_come_from():
    names = set(builtin_profiles())
    assert names >= REQUIRED
    for name in names:
        p = get_profile(name)
        assert p.name == name
        for key, fig in p.figures.items():
            assert fig.source, key
            assert fig.kind in ("datasheet", "measured", "estimate", "fitted")


def test_profile_figures_are_the_reference_numbers():
    assert get_profile("h100-sxm")["h2d_pinned_gbs"] == 55.4
    assert get_profile("gh200").link == "nvlink-c2c"
    assert get_profile("h200")["mem_bw_peak_gbs"] == 4800
    assert get_profile("a6000").link_bw == 25e9


def test_profile_round_trips_through_toml(tmp_path):
    p = get_profile("gh200")
    path = tmp_path / "mine.toml"
    path.write_text(p.to_toml())
    q = get_profile(str(path))
    assert q.figures == p.figures and q.link == p.link


def _write(tmp_path, text):
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("h2d_pinned_gbs = { value = 25.0", "h2d_pinned_gbs = { value = 0"), "must be positive"),
    (lambda t: t.replace("bf16_tflops = { value = 154.8", "bf16_tflops = { value = -3"), "must be positive"),
    (lambda t: "\n".join(line for line in t.splitlines() if not line.startswith("kernel_launch_us")), "missing required figure"),
    (lambda t: t.replace("[figures]", "colour = \"red\"\n[figures]"), "unknown key"),
    (lambda t: t + "warp_drive = { value = 1, kind = \"estimate\", source = \"x\" }\n", "unknown figure"),
    (lambda t: t.replace('kind = "datasheet"', 'kind = "rumour"', 1), "kind 'rumour'"),
    (lambda t: t.replace('link = "pcie4"', 'link = "carrier-pigeon"'), "link 'carrier-pigeon'"),
    (lambda t: t.replace("[figures]", "[figures"), "not valid TOML"),
    (lambda t: t.replace("compute_efficiency = { value = 0.6", "compute_efficiency = { value = 3"), "fraction"),
])
def test_bad_profiles_get_one_line_errors(tmp_path, edit, message):
    good = Path(get_profile("a6000").path).read_text()  # the shipped file: one inline table a figure
    path = _write(tmp_path, edit(good))
    with pytest.raises(MoesimError, match=message) as e:
        load_profile(path)
    assert "\n" not in str(e.value)


def test_unknown_profile_name():
    with pytest.raises(MoesimError, match="unknown hardware profile 'tpu9'"):
        get_profile("tpu9")
    with pytest.raises(MoesimError, match="does not exist"):
        get_profile("/nonexistent/x.toml")


def test_with_figure_validates():
    p = get_profile("a6000")
    assert p.with_figure("h2d_pinned_gbs", 64).link_bw == 64e9
    with pytest.raises(MoesimError):
        p.with_figure("h2d_pinned_gbs", 0)


def test_every_source_is_public_or_an_explained_estimate():
    for name in builtin_profiles():
        for key, fig in get_profile(name).figures.items():
            where = f"{name}.{key}"
            assert fig.source.strip(), where
            assert "shared/" not in fig.source and "reference/" not in fig.source, where
            if fig.kind == "datasheet":
                assert "https://" in fig.source, where  # the datasheet's title and address
            elif fig.kind in ("estimate", "measured"):
                # "estimate: <reasoning>" or "measured: <benchmark, paper or issue thread>"
                assert fig.source.startswith(f"{fig.kind}: ") and len(fig.source) > 40, where


@pytest.mark.parametrize("make, message", [
    (lambda p: p.with_suffix(".toml").write_bytes(b"name = \"x\"\n\xff\xfe not utf-8"), "not UTF-8"),
    (lambda p: p.with_suffix(".toml").write_bytes(b"name = \"x\"\x00\x01"), "binary data"),
    (lambda p: p.with_suffix(".toml").mkdir(), "is a directory"),
])
def test_unreadable_profiles_are_one_line(tmp_path, make, message):
    base = tmp_path / "prof"
    make(base)
    with pytest.raises(MoesimError, match=message) as e:
        get_profile(str(base.with_suffix(".toml")))
    assert "\n" not in str(e.value)


def test_a_trace_given_as_a_profile_is_one_line(tmp_path, tiny_trace):
    from moesim.traces.format import write_trace

    path = write_trace(tiny_trace, tmp_path / "t.npz")
    with pytest.raises(MoesimError, match="not a hardware profile|not valid TOML") as e:
        get_profile(str(path))
    assert "\n" not in str(e.value)


def test_measuring_this_machine_reports_each_step_it_counts_on(tmp_path, monkeypatch):
    """`moesim profile --hardware`'s progress bar divides by MEASURE_STEPS: a real CPU run
    must call its step callback exactly that often, or the time left is wrong. On a CPU it
    writes the machine as a host too, which --host reads back. Every figure is measured;
    each timing is taken once, not as the best of five (what is checked here is the steps
    and the files, not the figures' precision)."""
    torch = __import__("pytest").importorskip("torch")
    from moesim.executor import hwbench
    from moesim.executor.hwbench import MEASURE_STEPS, measure_to_file

    real = hwbench.best_time
    monkeypatch.setattr(hwbench, "best_time", lambda fn, repeat=5, warmup=True: real(fn, 1, warmup))
    from moesim.hardware import get_host

    torch.set_num_threads(1)
    steps: list[str] = []
    prof, path = measure_to_file("cpu", "counted", tmp_path / "counted.toml", 1, steps.append)
    assert len(steps) == MEASURE_STEPS["cpu"], steps
    assert prof.name == "counted" and prof["h2d_pinned_gbs"] > 0
    host = get_host(str(tmp_path / "counted-host.toml"))
    assert host.cores >= 1 and 0 < host["mem_bw_per_core_gbs"] <= host["mem_bw_peak_gbs"]
    assert all(f.kind == "measured" for f in host.figures.values())
