"""``moesim replay TRACE``. Python: ``moesim.sim.replay.replay(trace, hw, policies, replay_setting(...))``;
``--validate``: ``moesim.sim.validate.validate_trace``; speculative traces:
``moesim.sim.speculative.speculative_whatif``."""

from __future__ import annotations

from dataclasses import replace

from moesim.cli.app import err, print_csv, print_json
from moesim.cli.lists import policy_objects
from moesim.cli.options import (
    command_of,
    given_options,
    holding,
)
from moesim.cli.replay_args import REPLAY_POLICIES, ReplayArgs
from moesim.cli.replay_views import SD_WHATIF_OPTIONS, print_replay, print_validation, speculative_replay
from moesim.cli.running import progress_bar, writing_report
from moesim.engines import get_engine  # imported with the CLI anyway (moesim.policy's cost model)
from moesim.errors import MoesimError
from moesim.hardware import get_machine
from moesim.outputs import check_output_dir  # light (2 ms to import): checked before the lock
from moesim.policy import default_policies
from moesim.reports.replay import write_replay_report
from moesim.sim.replay import check_trace_model
from moesim.sim.replay import replay as run_replay
from moesim.traces.format import read_trace


@command_of(ReplayArgs)
def replay(a: ReplayArgs) -> None:
    """Replay a trace under one or more policies on a hardware profile.

    Prints TPOT (mean, p99, tokens/s), its compute / copy / stall breakdown, the bounds
    (serial copy+compute; ideal overlap), bytes moved, hit rates and TTFT, and names the
    profile, link and compute times it used.

    Example: `moesim replay run.npz --hw h100-sxm --policy on-demand,prefetch --cache-gib 8 --out run-report`
    """

    if a.out_dir is not None:
        check_output_dir(a.out_dir)  # before its lock file is made
    with holding(a.out_dir, "--out"):  # two runs on one report folder: the second refused (their files mixed)
        trace = read_trace(a.trace_path)
        if trace.speculative:
            return speculative_replay(trace, a)
        if sd := [o for o in ("--gamma", *SD_WHATIF_OPTIONS) if o in given_options(a.ctx)]:
            raise MoesimError(f"{', '.join(sd)}: for speculative-decoding traces (moesim speculate); this one is not")
        if a.validate:
            print_validation(trace, a.trace_path, a.hw_name, a.sim, a.as_json, a.out_dir, a.as_csv, a.copy_queue)
            return
        if a.model is not None:
            check_trace_model(trace, a.model, a.trace_path)
        # Names resolved once, here: the replay below takes the objects.
        pols = policy_objects(a.policy)
        setting = a.setting()
        if a.engine is not None:
            setting = replace(setting, engine=get_engine(a.engine))
            if a.policy == REPLAY_POLICIES:  # none chosen: the defaults the engine runs (as whatif)
                pols = policy_objects(",".join(default_policies(setting.engine, [p.name for p in pols])))
        machine = get_machine(a.hw_name) if a.hw_name else None
        with progress_bar("replaying", "layer-steps", disable=a.as_json) as update:
            rep = run_replay(trace, machine, pols, setting, a.changes(), step=a.step, where=a.trace_path,
                             progress=update)
        note = rep.note
        if a.as_json or a.as_csv:
            print_json(rep.rows) if a.as_json else print_csv(rep.rows)
        else:
            print_replay(rep, trace, a.sim)
        if a.out_dir is not None:

            with writing_report(a.out_dir):
                page = write_replay_report(trace, a.trace_path, rep.profile, rep.results, a.out_dir, rep.step,
                                           rep.rows)
            err.print(f"report: {page}")
        if note:
            err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)

