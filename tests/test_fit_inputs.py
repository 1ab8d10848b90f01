"""Every file `moesim fit --measured` reads goes through the input guard (issue "The first
hour, round 6", item 1): a FIFO nobody writes to, a device and a folder refused at once,
naming what it is; a pipe read once (process substitution works); a speed or a time that no
test could have measured refused naming the check, never an infinite speed or a traceback."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from cli_run import in_process, one_line_error

from moesim.measured import MEASURED_CAP

HOST = "ryzen-7950x"
TABLE = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| qwen3moe 30B.A3B Q4_K - Medium |  17.28 GiB |    30.53 B | CPU        |       8 |           tg128 |         24.10 ± 0.12 |
"""


def test_a_fifo_nobody_writes_to_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "run.md"
    os.mkfifo(fifo)
    one_line_error(in_process("fit", "--measured", str(fifo), "--out", str(tmp_path / "o")), "named pipe (FIFO)")


@pytest.mark.parametrize("path, words", [("/dev/zero", "a device"), ("/dev/urandom", "a device")])
def test_a_device_is_refused_before_reading(tmp_path, path, words):
    one_line_error(in_process("fit", "--measured", path, "--out", str(tmp_path / "o")), words)


def test_a_folder_is_refused(tmp_path):
    one_line_error(in_process("fit", "--measured", str(tmp_path), "--out", str(tmp_path / "o")), "is a folder")


def test_a_file_over_the_cap_is_refused_before_reading(tmp_path):
    big = tmp_path / "huge.log"
    with open(big, "wb") as f:
        f.truncate(MEASURED_CAP + 1)  # sparse: no bytes written, none read
    one_line_error(in_process("fit", "--measured", str(big), "--out", str(tmp_path / "o")), "at most 32 MiB")


def test_a_pipe_is_read_once_as_process_substitution_gives_it(tmp_path):
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "w") as f:
            f.write(TABLE)

    t = threading.Thread(target=feed)
    t.start()
    try:
        res = in_process("fit", "--measured", f"/dev/fd/{r}", "--model", "qwen3-30b-a3b", "--host", HOST,
                         "--out", str(tmp_path / "o"))
    finally:
        t.join()
        os.close(r)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "o" / "engine.toml").exists()


@pytest.mark.parametrize("column, value, words", [
    ("tpot_ms", "1e-320", "above 1,000,000 tokens/s"),
    ("tpot_ms", "1e308", "below 0.0001 tokens/s"),
    ("tokens_per_s", "1e308", "above 1,000,000 tokens/s"),
    ("tpot_ms", "0", "not a time"),
    ("tokens_per_s", "nan", "not a finite number"),
])
def test_a_speed_no_test_could_measure_is_refused_naming_the_check(tmp_path, column, value, words):
    path = Path(tmp_path / "runs.csv")
    path.write_text(f"model,hw,host,engine,policy,threads,{column}\n"
                    f"qwen3-30b-a3b,none,{HOST},llama.cpp,all-resident,8,{value}\n")
    one_line_error(in_process("fit", "--measured", str(path), "--out", str(tmp_path / "o")), "runs.csv:2", words)


def test_a_mean_latency_outside_its_own_samples_is_refused(tmp_path):
    """A vLLM JSON whose avg_latency is 100x its own latencies is no run's output: refused naming
    the check, never blamed on a busy machine."""
    import json

    data = json.loads((Path(__file__).parent / "data" / "measured" / "vllm_latency_0.33.0.json").read_text())
    data["avg_latency"] = 100 * data["avg_latency"]
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    one_line_error(in_process("fit", "--measured", str(path), "--output-len", "128", "--input-len", "32", "--batch",
                              "1", "--hw", "h100-sxm", "--model", "qwen3-30b-a3b", "--out", str(tmp_path / "o")),
                   "avg_latency", "outside its own latencies")
