"""``--host NAME@CHANNELSxMTS@Ns``: the memory system and sockets of one machine varied on the
command line (issue "Predictions that hold where nothing was fitted": RAM speed and channels
could only be changed by editing a TOML)."""

from __future__ import annotations

import json

import pytest

from moesim.errors import MoesimError
from moesim.hardware import get_host
from tests.cli_run import in_process


def test_a_variant_scales_the_bandwidth_by_channels_and_speed_and_keeps_the_rest():
    base = get_host("ryzen-9950x")
    v = get_host("ryzen-9950x@4x6400@2s")
    assert v.name == "ryzen-9950x@4x6400@2s" and v.sockets == 2
    assert v["mem_bw_peak_gbs"] == pytest.approx(4 * 6400 * 8 / 1000)
    share = base["mem_bw_achievable_gbs"] / base["mem_bw_peak_gbs"]
    assert v["mem_bw_achievable_gbs"] == pytest.approx(4 * 6400 * 8 / 1000 * share)
    assert v["cores"] == base["cores"] and v["bf16_tflops"] == base["bf16_tflops"]
    assert "4 channels x 6400 MT/s" in v.figures["mem_bw_peak_gbs"].source


@pytest.mark.parametrize("given,message", [
    ("ryzen-9950x@2", "CHANNELSxMTS"), ("ryzen-9950x@x6400", "CHANNELSxMTS"), ("ryzen-9950x@30x6400", "1 to 24"),
    ("ryzen-9950x@2x100", "800 to 20000"), ("ryzen-9950x@0s", "from 1 to 16"), ("ryzen-9950x@", "CHANNELSxMTS"),
    ("nope@2x4800", "unknown host profile 'nope'")])
def test_a_bad_variant_is_one_line(given, message):
    with pytest.raises(MoesimError, match=message):
        get_host(given)
    r = in_process("whatif", "--model", "olmoe-1b-7b", "--hw", "rtx4090", "--host", given, "--policy", "cpu-static",
                   "--tokens", "4", "--jobs", "1")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_whatif_sweeps_ram_speed_as_an_axis_and_faster_ram_is_faster_on_the_cpu(tmp_path):
    r = in_process("whatif", "--model", "qwen3-30b-a3b", "--hw", "rtx4090", "--host",
                   "ryzen-9950x@2x4800,ryzen-9950x@2x6400", "--engine", "llama.cpp", "--policy", "cpu-static",
                   "--cpu-layers", "48", "--tokens", "8", "--jobs", "1", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {x["host"]: x["tpot_ms"] for x in json.loads(r.stdout)["rows"]}
    assert set(rows) == {"ryzen-9950x@2x4800", "ryzen-9950x@2x6400"}
    assert rows["ryzen-9950x@2x6400"] < rows["ryzen-9950x@2x4800"]


@pytest.mark.parametrize("given,message", [("ryzen-9950x@2x6400@2x8000", "both set the memory channels and speed"),
                                           ("epyc-9654@2s@3s", "both set the sockets")])
def test_a_variant_says_each_thing_once(given, message):
    with pytest.raises(MoesimError, match=message):
        get_host(given)
