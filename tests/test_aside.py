"""``moesim.sim.pool.start_aside``: one forked process for work done beside the command's
(the planner's first compile, the what-if report's heatmap); a failure there is an exit
code, not a traceback, and the caller does the work itself."""

import os
import sys

import pytest

from moesim.sim.pool import start_aside

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="start_aside forks only with a second core")


def test_the_work_is_done_in_another_process(tmp_path):
    mark = tmp_path / "pid"
    proc = start_aside(lambda: mark.write_text(str(os.getpid())))
    proc.join(60)
    assert proc.exitcode == 0 and int(mark.read_text()) != os.getpid()


def test_a_failure_there_is_an_exit_code_and_says_nothing(capfd):
    def boom() -> None:
        raise RuntimeError("disk full")

    proc = start_aside(boom)
    proc.join(60)
    assert proc.exitcode == 1
    assert "Traceback" not in capfd.readouterr().err


def test_the_report_draws_the_heatmap_itself_when_the_other_process_failed(tmp_path, monkeypatch):
    from moesim.reports import whatif as report
    from moesim.sim.whatif import WhatifOptions, whatif

    res = whatif(WhatifOptions(models=["olmoe-1b-7b"], hws=["a6000"], policies=["on-demand", "prefetch-fom"],
                               link_gbps=[8, 16], cache_gib=[0, 1], tokens=4, jobs=1))
    report.write_whatif_report(res.rows, res.winner, "tpot", res.sweep, tmp_path / "a")
    monkeypatch.setattr(report, "start_aside", lambda draw: start_aside(lambda: sys.exit(3)))
    report.write_whatif_report(res.rows, res.winner, "tpot", res.sweep, tmp_path / "b")
    assert (tmp_path / "b" / "heatmap.png").read_bytes() == (tmp_path / "a" / "heatmap.png").read_bytes()
