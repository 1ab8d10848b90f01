"""What one measured row buys: bench/bench_llamacpp.py's llama-bench rows, calibrated on one.

    python bench/calibrate_llamacpp.py                 # writes bench/calibrate_llamacpp.json, prints the table
    python bench/calibrate_llamacpp.py --rows 1 2      # calibrate on rows 1 and 2 (1-based, the JSON's order)
    python bench/calibrate_llamacpp.py --gguf          # read the GGUF files instead (bench_llamacpp.py's work dir)

The rows are the committed measurements of ``bench/llamacpp.json`` (llama-bench on the pinned
llama.cpp build, tiny **synthetic** Qwen3-MoE GGUF files with Qwen3-30B-A3B's layer geometry,
1 and 2 threads, depth 0 and 1024, this machine's CPU); the host is the profile that run
measured (``host_profiles.before``, written back as a host TOML).

As a user takes it (the default): the rows are printed as llama-bench prints them (its
markdown: the model description with the file type, the file's size, the threads, ``tgN @
dD``); the calibration rows' table goes through ``moesim fit --measured TABLE --model
CONFIG --host HOST --out DIR``, run as a command, with no GGUF file present (``--model`` is
the Hugging Face config the files were converted from: bench_llamacpp.py's geometry), and
every other row is predicted from its own printed line with the profile that command wrote
(or, when it refused to write one, with the shipped profile the user keeps). With
``--gguf``, each row is the deployment of its GGUF file instead (the tensor types read from
the file), calibrated in-process. The calibration row is chosen by a fixed rule, the first
the benchmark lists; the table also gives every other one-row choice, so the figure is not
the luck of one row.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llamacpp import DEFAULT_WORK, QWEN3_30B_A3B_LAYER, VOCAB_SIZE, gguf_path  # noqa: E402

from moesim.atomic import atomic_write_text  # noqa: E402
from moesim.engines import get_engine, load_engine  # noqa: E402
from moesim.hardware import HOST_FIGURES, Figure, HostProfile  # noqa: E402
from moesim.measured import MeasuredRow, llama_bench_md, read_measured  # noqa: E402
from moesim.quant_recipes import printed_name  # noqa: E402
from moesim.sim.calibrate import Given, _ln_errors, calibrate_entries, deployment  # noqa: E402

WITHIN = 0.15


def host_file(result: dict, out: Path) -> Path:
    """The host profile the benchmark measured before its rows, as a host TOML."""
    h = result["host_profiles"]["before"]
    figs = {k: Figure(float(v), "measured", f"moesim profile --hardware on this machine, {h['when']} "
                                              "(bench/llamacpp.json host_profiles.before)")
            for k, v in h["figures"].items() if k in HOST_FIGURES}
    prof = HostProfile("bench-llamacpp-host", "the 2-core EPYC VM of bench/llamacpp.json", figs, str(out))
    atomic_write_text(out, prof.to_toml())
    return out


def measured_rows(result: dict, work: Path) -> list[MeasuredRow]:
    rows = []
    for i, r in enumerate(result["rows"], 1):
        path = gguf_path(work, r["layers"], r["format"])
        if not path.exists():
            raise SystemExit(f"{path} missing: python bench/bench_llamacpp.py --skip-build builds it")
        rows.append(MeasuredRow(where=f"llamacpp.json row {i} ({r['model']} -t {r['threads']} -d {r['depth']})",
                                engine="llama.cpp", test="decode", tokens_per_s=float(r["measured_tok_s"]),
                                n_gen=int(r["n_gen"]), depth=int(r["depth"]), model_file=str(path),
                                threads=int(r["threads"]), n_gpu_layers=0))
    return rows


def configs(work: Path) -> dict[int, Path]:
    """The Hugging Face configs the GGUF files were converted from (bench_llamacpp.py's geometry), by layers."""
    out = {}
    for layers in (2, 4):
        d = work / "configs" / f"qwen3moe-a3b-geom-{layers}L"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "config.json", json.dumps({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB_SIZE,
            "num_hidden_layers": layers, **QWEN3_30B_A3B_LAYER}, indent=1))
        out[layers] = d
    return out


def printed_rows(result: dict, work: Path) -> tuple[list[MeasuredRow], list[Path]]:
    """The rows as llama-bench prints them (one table, read back as fit --measured reads it), and each one's config."""
    sizes = {m["name"]: m["file_bytes"] for m in result["models"]}
    rows = [MeasuredRow(where="", engine="llama.cpp", test="decode", tokens_per_s=float(r["measured_tok_s"]),
                        n_gen=int(r["n_gen"]), depth=int(r["depth"]), threads=int(r["threads"]), backend="CPU",
                        model_type=f"qwen3moe ?B {printed_name(r['format'])}", model_bytes=sizes.get(r["model"]),
                        spread=(float(r["measured_min"]), float(r["measured_max"])))
            for r in result["rows"]]
    build = f"{result['llama_cpp']['build_commit']} ({result['llama_cpp']['build_number']})"
    table = work / "results" / "llamacpp-rows.md"
    atomic_write_text(table, llama_bench_md(rows, build))
    cfg = configs(work)
    return read_measured(table), [cfg[int(r["layers"])] for r in result["rows"]]


def fit_measured(rows: list[MeasuredRow], model: Path, host: Path, out: Path, build: str) -> tuple[dict, bool, str]:
    """``moesim fit --measured`` on ``rows`` printed as llama-bench prints them, as a command:
    (its fitted figures, whether it wrote a profile, its last line)."""
    table = out.with_suffix(".md")
    atomic_write_text(table, llama_bench_md(rows, build))
    run = subprocess.run([sys.executable, "-m", "moesim", "fit", "--measured", str(table), "--model", str(model),
                          "--host", str(host), "--out", str(out)], capture_output=True, text=True)
    last = (run.stderr.strip().splitlines() or [""])[-1]
    if run.returncode not in (0, 1):
        raise SystemExit(f"moesim fit --measured failed: {run.stderr}")
    fitted = {}
    for line in run.stdout.splitlines():
        if line.startswith("fitted: "):
            fitted = {k.strip(): float(v.split()[0]) for k, v in (p.split(" = ") for p in line[8:].split(" (on ")[0]
                                                                   .split(", ") if " = " in p)}
    return fitted, run.returncode == 0, last


def score(entries, engine, held: list[int]) -> dict:
    ln = _ln_errors([entries[i] for i in held], engine)
    return {"rows": len(held), "within_15": int(sum(abs(math.expm1(x)) <= WITHIN for x in ln)),
            "median_abs_ln": float(statistics.median(abs(x) for x in ln)), "worst_abs_ln": float(max(abs(x) for x in ln)),
            "ratios": [round(math.exp(x), 3) for x in ln]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "llamacpp.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="1-based rows to calibrate on (default: the first)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "calibrate_llamacpp.json")
    ap.add_argument("--no-every", action="store_true", help="skip the table of every one-row choice")
    ap.add_argument("--gguf", action="store_true", help="each row as its GGUF file (bench_llamacpp.py's work dir), "
                                                        "calibrated in-process, instead of its printed line")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text())
    host = host_file(result, args.work / "results" / "bench-llamacpp-host.toml")
    base = get_engine("llama.cpp")
    if args.gguf:
        rows = measured_rows(result, args.work)
        entries = [deployment(r, Given("none", str(host), "llama.cpp")) for r in rows]
    else:
        rows, models = printed_rows(result, args.work)
        entries = [deployment(r, Given("none", str(host), "llama.cpp", str(m))) for r, m in zip(rows, models)]
    build = f"{result['llama_cpp']['build_commit']} ({result['llama_cpp']['build_number']})"
    every = list(range(len(entries)))

    def calibrated_on(chosen: list[int], what: str) -> tuple[dict, object, str]:
        """(fitted figures, the engine the others are predicted with, how)."""
        if args.gguf:
            cal = calibrate_entries([entries[i] for i in chosen], base, what, loro=False)
            return cal.figures, cal.engine, "in-process"
        out = args.work / "results" / f"fit-measured-rows-{'-'.join(str(i + 1) for i in chosen)}"
        models = {entries[i].setting["model"] for i in chosen}
        if len(models) != 1:
            raise SystemExit("calibrate on rows of one model (one --model)")
        fitted, wrote, last = fit_measured([rows[i] for i in chosen], Path(models.pop()), host, out, build)
        return fitted, load_engine(out / "engine.toml") if wrote else base, \
            "fit --measured wrote a profile" if wrote else f"fit --measured wrote none: {last}"

    chosen = [k - 1 for k in args.rows]
    held = [i for i in every if i not in chosen]
    fitted, engine, how = calibrated_on(chosen, f"rows {args.rows} of bench/llamacpp.json")
    report = {"path": "in-process on the GGUF files" if args.gguf else
              "printed as llama-bench prints it, calibrated by the moesim fit --measured command",
              "calibrated_on": [f"row {i + 1} ({result['rows'][i]['model']} -t {result['rows'][i]['threads']} "
                                f"-d {result['rows'][i]['depth']})" for i in chosen],
              "fitted": fitted, "how": how,
              "uncalibrated": score(entries, base, held), "calibrated": score(entries, engine, held)}
    print(f"calibrated on {', '.join(report['calibrated_on'])}: {how}; fitted {fitted}")
    for k in ("uncalibrated", "calibrated"):
        s = report[k]
        print(f"  {k}: {s['within_15']} of {s['rows']} other rows within +-15%, median |ln| {s['median_abs_ln']:.3f}, "
              f"worst {s['worst_abs_ln']:.2f}")
    if not args.no_every and len(chosen) == 1:
        report["every_one_row_choice"] = []
        for i in every:
            f, eng, how_i = calibrated_on([i], f"row {i + 1}")
            s = score(entries, eng, [j for j in every if j != i])
            report["every_one_row_choice"].append({"row": i + 1, "fitted": f, "how": how_i, **s})
            print(f"  on row {i + 1}: {s['within_15']} of {s['rows']} within +-15% ({how_i[:60]})")
        counts = [c["within_15"] for c in report["every_one_row_choice"]]
        print(f"  over every one-row choice: median {statistics.median(counts)} of {len(every) - 1}, "
              f"range {min(counts)}-{max(counts)}")
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
