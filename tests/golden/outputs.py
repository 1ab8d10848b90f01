"""The committed outputs a refactor must leave byte-identical (issue 53's comparison).

Each output is a real ``moesim`` command run as a user runs it (``python -m moesim``, in
a fresh folder, 200 columns): the README's bare ``moesim whatif`` (table, CSV, JSON),
``replay --json`` of every registered policy on one GPU and of the static layouts on two,
two deployment answers with an engine's arguments (the README's llama.cpp examples:
one GPU, and two GPUs with ``--cpu-layers``), and ``validate --published``, whose summary the
README quotes as its accuracy figures. The traces are synthetic (``moesim synth``,
fixed seeds).

    python tests/golden/outputs.py          # compare with the committed files (exit 1 on a difference)
    python tests/golden/outputs.py --write  # rewrite them (a change that means to move outputs says so)
    python tests/golden/outputs.py --fast   # without validate --published (3 minutes)

``tests/test_golden.py`` runs the comparison in the suite.
"""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Every registered policy, in the order the replay prints them (a new one joins the golden set by --write).
POLICIES = ("on-demand,prefetch-fom,prefetch-spec,oracle,all-resident,cpu-static,gpu-layers,hot-experts,cpu-on-miss,"
            "weight-streaming")

#: (name of the stdout file or None, arguments, {file the command writes: name it is kept under}).
COMMANDS: tuple[tuple[str | None, tuple[str, ...], dict[str, str]], ...] = (
    ("whatif.txt", ("whatif",), {"moesim-whatif/whatif.csv": "whatif.csv", "moesim-whatif/whatif.json": "whatif.json"}),
    (None, ("synth", "--model", "olmoe-1b-7b", "--tokens", "32", "--seed", "3", "--out", "t.npz"), {}),
    (None, ("synth", "--model", "olmoe-1b-7b", "--tokens", "32", "--seed", "4", "--out", "cal.npz"), {}),
    ("replay.json", ("replay", "t.npz", "--hw", "a6000", "--host", "epyc-7742", "--policy", POLICIES, "--cache-gib", "2",
                     "--placement-from", "cal.npz", "--gpu-expert-gib", "4", "--json"), {}),
    ("replay-2gpu.json", ("replay", "t.npz", "--hw", "2xrtx4090", "--host", "epyc-7742", "--policy",
                          "all-resident,cpu-static,gpu-layers,weight-streaming", "--json"), {}),
    ("deploy-4090.txt", ("whatif", "--model", "qwen3-30b-a3b", "--expert-dtype", "q4_k_m", "--hw", "rtx4090", "--host",
                         "ryzen-7950x", "--host-ram-gb", "64", "--engine", "llama.cpp", "--ctx", "32768", "--tokens", "64",
                         "--jobs", "1", "--out", "d1"), {"d1/whatif.csv": "deploy-4090.csv"}),
    ("deploy-2x5090.txt", ("whatif", "--model", "gpt-oss-120b", "--hw", "2xrtx5090", "--host", "ryzen-7950x",
                           "--host-ram-gb", "128", "--engine", "llama.cpp", "--cpu-layers", "auto,3", "--tokens", "64",
                           "--jobs", "1", "--out", "d2"), {"d2/whatif.csv": "deploy-2x5090.csv"}),
)


#: Outputs too slow for the default suite (``-m slow`` compares them): ``validate --published``
#: (leave one source out over every published source, about 3 minutes on 2 cores), whose
#: summary lines the README quotes as the accuracy figures, with the targets of moesim.sim.targets.
SLOW_COMMANDS: tuple[tuple[str | None, tuple[str, ...], dict[str, str]], ...] = (
    ("validate-published.txt", ("validate", "--published"), {}),
)


def generate(out: Path, commands=COMMANDS) -> dict[str, bytes]:
    """Run ``commands`` in a fresh folder under ``out``; the outputs by file name."""
    work = out / "work"
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "COLUMNS": "200", "LINES": "50"}
    got: dict[str, bytes] = {}
    for stdout_name, args, files in commands:
        r = subprocess.run([sys.executable, "-m", "moesim", *args], cwd=work, env=env, capture_output=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"moesim {' '.join(args)} exited {r.returncode}: {r.stderr.decode()[-2000:]}")
        if stdout_name:
            got[stdout_name] = r.stdout
        for path, name in files.items():
            got[name] = (work / path).read_bytes()
    return got


def differences(got: dict[str, bytes]) -> list[str]:
    """One entry per output that differs from its committed file (with the diff's first lines)."""
    out = []
    for name, data in got.items():
        kept = HERE / name
        if not kept.exists():
            out.append(f"{name}: no committed file (python tests/golden/outputs.py --write)")
        elif kept.read_bytes() != data:
            diff = difflib.unified_diff(kept.read_text().splitlines(), data.decode().splitlines(), f"committed {name}",
                                        f"now {name}", lineterm="", n=0)
            out.append("\n".join(list(diff)[:20]))
    return out


def main(argv: list[str]) -> int:
    commands = COMMANDS if "--fast" in argv else (*COMMANDS, *SLOW_COMMANDS)
    with tempfile.TemporaryDirectory() as tmp:
        got = generate(Path(tmp), commands)
    if "--write" in argv:
        for name, data in got.items():
            (HERE / name).write_bytes(data)
        print(f"wrote {len(got)} outputs to {HERE}")
        return 0
    diffs = differences(got)
    print("\n\n".join(diffs) if diffs else f"all {len(got)} outputs byte-identical")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
