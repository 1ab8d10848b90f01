"""Every llama.cpp command moesim prints, fed to llama.cpp's own argument parser.

Why: the deployment answer prints `llama-server ...` lines users paste into a terminal; a
flag llama.cpp does not take, or a value it refuses, is an answer that does not run. This
builds llama-server (the CPU backend of the llama.cpp that bench/bench_llamacpp.py pins:
the llama-cpp-python 0.3.36 sdist, vendor/llama.cpp; no GPU is needed to parse arguments)
and runs each printed command with `--version` appended: llama.cpp's parser handles the
arguments in order and `--version` prints and exits 0 once every argument before it was
accepted, so exit 0 with the version line means "parsed", and anything else prints
llama.cpp's own error. The model path (MODEL.gguf) is never opened.

The commands: every `llama-server` line of README.md, and the llama.cpp answers of what-if
sweeps on 1, 2 and 3 GPUs (`moesim whatif --engine llama.cpp --json`, its `deployment`
invocations: -ngl, --n-cpu-moe, --tensor-split, --split-mode row, -ot, -t, -c). Each row
also says whether the printed split is the planned one: the layers per GPU that
--tensor-split gives (llama.cpp's rule: each layer to the GPU whose cumulative share its
index falls in) against the plan's.

Run:  python bench/check_llamacpp_args.py [--work DIR] [--out bench/llamacpp_args.json]
Time: the llama-server build, about 10 minutes on 2 cores the first time (cached in the
work dir, ~/.cache/moesim/llamacpp as bench_llamacpp.py's); then a few seconds a command.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp as bl  # noqa: E402  (bench/ is not a package: the pinned source and its build)

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = [  # (model, machine, host): one, two and three GPUs, CPU experts and whole-layer splits
    ("qwen3-30b-a3b", "rtx4090", "ryzen-7950x"),
    ("qwen3-30b-a3b", "2xrtx3090", "epyc-7742"),
    ("qwen3-30b-a3b", "rtx5090+rtx3090", "ryzen-9950x"),
    ("qwen3-30b-a3b", "3xrtx3090", "epyc-7742"),
    ("gpt-oss-120b", "2xrtx5090", "ryzen-9950x"),
    ("deepseek-v3", "3xrtx3090", "epyc-9654"),
]


def build_server(work: Path, jobs: int = 2) -> Path:
    """llama-server of the pinned llama.cpp (CPU backend), built once into the work dir."""
    llama_dir = bl.fetch_source(work)
    binary = llama_dir / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    bl._run(["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"],
            cwd=llama_dir, nice=10, log_path=work / "cmake_configure_server.log")
    bl._run(["cmake", "--build", "build", "--target", "llama-server", f"-j{jobs}"], cwd=llama_dir, nice=10,
            log_path=work / "cmake_build_server.log")
    return binary


def readme_commands() -> list[dict]:
    out = []
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        t = line.strip()
        if t.startswith("llama-server "):
            out.append({"from": "README.md", "args": shlex.split(t)[1:]})
    return out


def sweep_commands() -> list[dict]:
    out = []
    for model, hw, host in SWEEPS:
        cmd = [sys.executable, "-m", "moesim", "whatif", "--model", model, "--hw", hw, "--host", host, "--engine",
               "llama.cpp", "--tokens", "8", "--jobs", "1", "--json", "--out", "/tmp/moesim-check-args"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        for dep in json.loads(r.stdout)["deployment"]:
            for fam in dep["families"]:
                inv = fam.get("invocation")
                if inv and fam.get("row", {}).get("fits"):
                    args = list(inv["args"])
                    args = args[1:] if args and args[0] == "llama-server" else args  # the program, not an argument
                    out.append({"from": f"whatif {model} {hw}: {fam['family']}", "args": args,
                                "row": {k: fam["row"].get(k) for k in ("cpu_layers", "gpu_layers", "device_gb_needed")}})
    return out


def split_matches(args: list[str], hw: str, model: str) -> bool | None:
    """Whether --tensor-split, read as llama.cpp reads it, puts on each GPU the layers the plan
    timed (None: no --tensor-split, or not a what-if row)."""
    if "--tensor-split" not in args or "--split-mode" in args:
        return None
    from moesim.hardware import get_machine
    from moesim.layout import layer_shares
    from moesim.models import get_model

    shares = [float(x) for x in args[args.index("--tensor-split") + 1].split(",")]
    ngl = min(int(args[args.index("-ngl") + 1]), get_model(model).n_layers)
    per_gpu = [int((layer_shares(ngl, shares) == i).sum()) for i in range(len(shares))]
    return len(shares) == get_machine(hw).n_gpus and per_gpu == [int(round(s)) for s in shares]


def check(binary: Path, args: list[str]) -> dict:
    t0 = time.time()
    r = subprocess.run([str(binary), *args, "--version"], capture_output=True, text=True, timeout=60)
    text = (r.stdout + r.stderr).strip()
    parsed = r.returncode == 0 and re.search(r"version: \d+", text) is not None
    return {"parsed": parsed, "exit": r.returncode, "said": text.splitlines()[-1] if text else "",
            "seconds": round(time.time() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=bl.DEFAULT_WORK)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "llamacpp_args.json")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    t0 = time.time()
    binary = build_server(a.work, a.jobs)
    build_s = round(time.time() - t0, 1)
    rows = []
    for c in readme_commands() + sweep_commands():
        res = check(binary, c["args"])
        model_hw = re.match(r"whatif (\S+) (\S+):", c["from"])
        split = split_matches(c["args"], model_hw.group(2), model_hw.group(1)) if model_hw else None
        rows.append({**c, **res, "split_is_the_plans": split})
        print(f"{'parsed ' if res['parsed'] else 'REFUSED'} {c['from']}: {' '.join(c['args'])}"
              + ("" if res["parsed"] else f"  ({res['said']})"))
    # The check can fail: a misspelt flag and a malformed split must be refused by the same parser.
    controls = [check(binary, args) for args in (["-m", "MODEL.gguf", "--n-cpu-moes", "2"],
                                                 ["-m", "MODEL.gguf", "--split-mode", "rows"])]
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    doc = {"what": "moesim's printed llama.cpp commands through llama-server's argument parser (--version last)",
           "llama_cpp": {"sdist": f"{bl.SDIST_NAME}=={bl.SDIST_VERSION}", "version": version[:2],
                         "build_s_this_run": build_s},
           "command": "python bench/check_llamacpp_args.py",
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "controls_refused": [not c["parsed"] for c in controls], "controls": controls,
           "summary": {"commands": len(rows), "parsed": sum(r["parsed"] for r in rows),
                       "splits_checked": sum(r["split_is_the_plans"] is not None for r in rows),
                       "splits_as_planned": sum(r["split_is_the_plans"] is True for r in rows)},
           "rows": rows}
    a.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(doc["summary"]))
    return 0 if doc["summary"]["parsed"] == len(rows) and all(doc["controls_refused"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
