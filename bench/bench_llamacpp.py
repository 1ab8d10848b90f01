"""Real llama.cpp decode speed on this machine for tiny MoE checkpoints with Qwen3-30B-A3B's per-layer geometry.

Why: moesim predicts all-CPU llama.cpp deployments; this script measures the real engine on the same kind of
layer and puts moesim's prediction beside every row (bench/predict_llamacpp.py: the GGUF file's own spec, this
machine's host profile measured by measure_host right before and after the rows, the llama.cpp engine profile).
The checkpoints are **synthetic** (seeded random weights): decode speed does not depend on the weights' values.

What it does (every step is cached in the work dir, default ~/.cache/moesim/llamacpp, so a rerun skips
finished steps; delete a step's output to redo it, or pass --remeasure to re-run only llama-bench):
  1. source   `pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36` and unpack it; the sdist
              vendors all of llama.cpp (vendor/llama.cpp, commit 0c1e57098) incl. convert_hf_to_gguf.py,
              gguf-py and tools/llama-bench.
  2. build()  CPU backend: cmake -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release, targets
              llama-bench and llama-quantize, `nice -n 10`, -j2 (about 10-15 min on 2 cores).
  3. make_checkpoints()  Qwen3MoeForCausalLM with Qwen3-30B-A3B's layer geometry (hidden 2048, 32 q heads,
              4 kv heads, head_dim 128, 128 experts x 768, top-8, norm_topk_prob) and 2 and 4 layers, seeded
              random bf16 weights, a ~1k-token byte-level BPE tokenizer trained with `tokenizers` (the real vocab
              is 151,936; a small one keeps the embedding/LM head from dominating), save_pretrained (safetensors).
  4. convert() the sdist's own convert_hf_to_gguf.py -> GGUF bf16 and Q8_0; llama-quantize bf16 -> Q4_K_M.
              Records file bytes and tensor types (gguf.GGUFReader).
  5. measure() llama-bench -p 0 -n 32 -t T -d D -r 5 -o json, one process per (file, T in 1,2, D in 0,1024);
              a pure-Python reference loop (2e6 float multiply-adds) and this machine's host profile
              (measure_host, as `moesim profile --hardware` writes NAME-host.toml) are measured before and after
              the rows, so other machines can be compared and the prediction sees the rows' contention.
  6. predict_llamacpp.predict_rows(): moesim's tok/s for each row (all-CPU, --hw none, engine llama.cpp,
              threads T, a synthetic trace whose prompt is D), with the host profile as measured and with its
              compute rate replaced by an fp32 GEMM measured beside it; optionally llama.cpp's CPU weight
              efficiency FITTED on the 2-layer rows and reported on the 4-layer ones (--fit-layers).
  7. check_engine_args(): the llama.cpp arguments moesim prints (moesim.engine_args, in its llama-bench
              spelling) for all-CPU, all-resident, cpu-static (--n-cpu-moe and its -ot spelling), gpu-layers
              and two-GPU deployments of the 2-layer Q4_K_M file, each run through run_llama_bench(); the
              llama-server spelling verbatim too where it differs. check_extra_args(): user-typed flags.
  8. writes bench/llamacpp.json (machine, llama_cpp version, reference loop, host profiles, models, rows with
              measured and predicted tok/s, summary, fit, engine_args_checks, extra_args_checks) and the proposed
              README subsection (write_readme: bench/llamacpp.md by default).

Time (first run, 2 shared cores): build ~8 min, checkpoints ~1.5 min, conversions ~12 min (the converter and
llama-quantize write 15-25 MB/s), measuring 24 rows ~5 min on an idle machine, but up to hours on a busy one:
each row waits for the machine to be idle (others share it) and contended rows are retried (see bench_quiet;
rows that stay contended are flagged "contended": true, and a rerun retries only them). With everything cached a
rerun takes seconds.
Disk: ~21 GB in the work dir (HF checkpoints 2.5 + 5.0 GB, GGUF bf16 2.5 + 5.0, Q8_0 1.3 + 2.7, Q4_K_M 0.76 + 1.5,
llama.cpp source + build ~0.3 GB); the HF checkpoints may be deleted once converted. Nothing built is written
into the repo. RAM: ~6 GB peak (building the 4-layer checkpoint).

Run:   python bench/bench_llamacpp.py [--work DIR] [--out FILE] [--skip-build] [--remeasure] [--quick]
Rerun everything from the caches on an idle machine (no build, no conversion; a few minutes):
       python bench/bench_llamacpp.py --skip-build --remeasure
Regenerate only the README text from the JSON: python bench/bench_llamacpp.py --readme-only
Reuse: import by path (bench/ is not a package), e.g.
         import importlib.util; s = importlib.util.spec_from_file_location("bl", "bench/bench_llamacpp.py")
         bl = importlib.util.module_from_spec(s); s.loader.exec_module(bl)
         bl.run_llama_bench(path, ["-ngl", "0", "--n-cpu-moe", "1"])

Extra arguments on this CPU-only build of llama-bench (0c1e57098), as checked by check_extra_args() and
recorded under "extra_args_checks" in llamacpp.json:
  accepted and run:  -ngl 0, -ngl 99 (nothing to offload: no GPU device), --n-cpu-moe 1 / -ncmoe 1,
                     -ot "ffn_.*_exps=CPU", -ot "exps=CPU", -fa 1, -ts 1/1
  NOTE llama-bench's -ts separates devices with "/" (or ";"), and "," separates *test values*: "-ts 1,1" is
  accepted but means two test runs with split [1], not a 1:1 split as in llama-server/llama-cli.
  refused (exit 1):  -ot "exps=CUDA0" (unrecognized buffer type; only CPU exists; the error is on stdout),
                     --cpu-moe / -cmoe (llama-server/cli spellings that llama-bench does not have).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # predict_llamacpp beside it

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"  # newest on PyPI when written; its CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"
DEFAULT_WORK = Path.home() / ".cache" / "moesim" / "llamacpp"
DEFAULT_OUT = Path(__file__).resolve().parent / "llamacpp.json"
DEFAULT_README = Path(__file__).with_name("llamacpp.md")  # the README subsection, pasted into README.md

LAYERS = (2, 4)
FORMATS = ("bf16", "q8_0", "q4_k_m")
THREADS = (1, 2)
DEPTHS = (0, 1024)
N_GEN = 32
REPS = 5
SEED = 0
# A run is "contended" (then retried, and flagged in the output) when other processes' CPU use plus its own
# threads exceeded the machine's cores by more than MAX_OVERSUB cores, or its samples' std/mean exceeds MAX_CV.
MAX_OVERSUB = 0.2
MAX_CV = 0.15
VOCAB_SIZE = 1024

# Qwen3-30B-A3B's config.json, minus the layer count and the vocabulary.
QWEN3_30B_A3B_LAYER = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    intermediate_size=6144,  # dense-MLP size; unused (every layer is MoE) but kept as in the real config
    max_position_embeddings=40960,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    attention_bias=False,
    hidden_act="silu",
)

# Qwen2/Qwen3's pre-tokenizer, verbatim from their tokenizer.json; llama.cpp implements it as pre-type "qwen2".
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# The BPE pre-tokenizer check. convert_hf_to_gguf.py identifies a BPE pre-tokenizer by hashing the token ids
# its tokenizer gives for a fixed test string, and refuses unknown hashes. The ids depend on the vocabulary and
# merges, not only on the pre-tokenizer, so *no* freshly trained tokenizer can hit a known hash, even one whose
# pre-tokenizer is exactly Qwen2's. The converter's documented mechanism (convert_hf_to_gguf_update.py) downloads
# the reference tokenizers from huggingface.co (unreachable here) and rewrites the converter's source. We choose
# instead: train the tokenizer with Qwen2's pre-tokenizer verbatim (normalizer, Split regex, ByteLevel), and run
# the unmodified converter through this wrapper, which answers "qwen2" only when the checkpoint's tokenizer.json
# carries exactly that pre-tokenizer, and otherwise defers to the converter's own hash check. No file of the
# sdist is edited, and the GGUF gets the pre-type that really describes its tokenizer.
_CONVERT_WRAPPER = r"""
import json, runpy, sys
from pathlib import Path
llama_dir, expected = Path(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, str(llama_dir))
sys.path.insert(1, str(llama_dir / "gguf-py"))
from conversion import base
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    tj = json.loads((Path(self.dir_model) / "tokenizer.json").read_text(encoding="utf-8"))
    if tj.get("pre_tokenizer") == expected["pre_tokenizer"] and tj.get("normalizer") == expected["normalizer"]:
        base.logger.info("tokenizer.json has Qwen2's pre-tokenizer verbatim: tokenizer.ggml.pre = 'qwen2'")
        return "qwen2"
    return _orig(self, tokenizer)
base.TextModel.get_vocab_base_pre = _pre
script = str(llama_dir / "convert_hf_to_gguf.py")
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
"""


def log(msg: str) -> None:
    print(f"[bench_llamacpp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run(cmd: Sequence[str], *, cwd: Path | None = None, nice: int = 0, log_path: Path | None = None) -> None:
    cmd = [str(c) for c in cmd]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    log(" ".join(c if len(c) < 160 else f"<{len(c)} chars>" for c in cmd))
    if log_path is None:
        subprocess.run(cmd, cwd=cwd, check=True)
        return
    with open(log_path, "w") as fh:
        proc = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}); log {log_path}:\n{tail}")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------------- step 1


def fetch_source(work: Path = DEFAULT_WORK) -> Path:
    """Download and unpack the pinned llama-cpp-python sdist; return its vendor/llama.cpp directory."""
    work.mkdir(parents=True, exist_ok=True)
    root = work / f"llama_cpp_python-{SDIST_VERSION}"
    llama_dir = root / "vendor" / "llama.cpp"
    if (llama_dir / "tools" / "llama-bench").is_dir() and (root / ".unpacked").exists():
        return llama_dir
    tarball = work / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not tarball.exists():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"{SDIST_NAME}=={SDIST_VERSION}", "-d", work])
    log(f"unpacking {tarball.name}")
    with tarfile.open(tarball) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(work, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tf.extractall(work)
    (root / ".unpacked").touch()
    return llama_dir


def llama_cpp_info(llama_dir: Path) -> dict:
    """Version of the vendored llama.cpp: the sdist carries its git submodule dir, and its CHANGELOG names it."""
    info = {"sdist": f"{SDIST_NAME}=={SDIST_VERSION}", "commit": None}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["commit"] = subprocess.run(["git", "-C", str(llama_dir), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, check=True).stdout.strip()
    changelog = llama_dir.parent.parent / "CHANGELOG.md"
    if changelog.exists():
        m = re.search(rf"## \[{re.escape(SDIST_VERSION)}\].*?ggml-org/llama\.cpp@([0-9a-f]+)", changelog.read_text(),
                      re.S)
        if m:
            info["changelog_commit"] = m.group(1)
            info["commit"] = info["commit"] or m.group(1)
    tarball = llama_dir.parent.parent.parent / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if tarball.exists():
        info["sdist_sha256"] = hashlib.sha256(tarball.read_bytes()).hexdigest()
    ggml_cmake = (llama_dir / "ggml" / "CMakeLists.txt").read_text()
    ver = [re.search(rf"set\(GGML_VERSION_{k}\s+(\d+)\)", ggml_cmake) for k in ("MAJOR", "MINOR", "PATCH")]
    if all(ver):
        info["ggml_version"] = ".".join(v.group(1) for v in ver)
    return info


# ----------------------------------------------------------------------------------------------------- step 2


def binaries(work: Path = DEFAULT_WORK) -> dict[str, Path]:
    bindir = work / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp" / "build" / "bin"
    return {"llama-bench": bindir / "llama-bench", "llama-quantize": bindir / "llama-quantize"}


def build(work: Path = DEFAULT_WORK, jobs: int = 2) -> dict:
    """Build llama-bench and llama-quantize (CPU backend); skip if both exist. Returns paths and build time."""
    llama_dir = fetch_source(work)
    bins = binaries(work)
    stamp = work / "build_info.json"
    if all(p.exists() for p in bins.values()) and stamp.exists():
        return {**json.loads(stamp.read_text()), **{k: str(v) for k, v in bins.items()}}
    incremental = (llama_dir / "build" / "CMakeCache.txt").exists()  # then build_s is not a from-scratch time
    t0 = time.time()
    _run(["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"],
         cwd=llama_dir, nice=10, log_path=work / "cmake_configure.log")
    t1 = time.time()
    _run(["cmake", "--build", "build", "--target", "llama-bench", "llama-quantize", f"-j{jobs}"],
         cwd=llama_dir, nice=10, log_path=work / "cmake_build.log")
    info = {"configure_s": round(t1 - t0, 1), "build_s": round(time.time() - t1, 1), "jobs": jobs, "incremental": incremental,
            "cmake_flags": ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"],
            "compiler": _first_line(["c++", "--version"])}
    _write_json(stamp, info)
    return {**info, **{k: str(v) for k, v in bins.items()}}


def _first_line(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        return None


# ----------------------------------------------------------------------------------------------------- step 3


def _tokenizer_corpus(llama_dir: Path) -> list[str]:
    """Deterministic training text: the markdown docs of the pinned llama.cpp sdist (sorted)."""
    files = sorted(p for p in (llama_dir / "docs").rglob("*.md")) + [llama_dir / "README.md"]
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(llama_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE with Qwen2's normalizer / pre-tokenizer / decoder, trained to `vocab_size` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(llama_dir), trainer)
    assert tok.get_vocab_size() <= vocab_size, tok.get_vocab_size()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", add_bos_token=False, clean_up_tokenization_spaces=False)


def _expected_pretok() -> str:
    """The normalizer/pre_tokenizer JSON our tokenizer carries; passed to the converter wrapper."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tj = json.loads(t.to_str())
    return json.dumps({"pre_tokenizer": tj["pre_tokenizer"], "normalizer": tj["normalizer"]})


def checkpoint_dir(work: Path, layers: int) -> Path:
    return work / "hf" / f"qwen3moe-a3b-geom-{layers}L"


def make_checkpoints(work: Path = DEFAULT_WORK, layers: Sequence[int] = LAYERS, seed: int = SEED) -> dict[int, Path]:
    """Seeded random bf16 Qwen3-MoE checkpoints with Qwen3-30B-A3B's layer geometry, hub layout (safetensors)."""
    llama_dir = fetch_source(work)
    out: dict[int, Path] = {}
    tokenizer = None
    for n_layers in layers:
        d = checkpoint_dir(work, n_layers)
        out[n_layers] = d
        if (d / ".complete").exists():
            continue
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        if tokenizer is None:
            tokenizer = train_tokenizer(llama_dir)
        if d.exists():
            shutil.rmtree(d)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
        config = Qwen3MoeConfig(vocab_size=VOCAB_SIZE, num_hidden_layers=n_layers, bos_token_id=ids["<|endoftext|>"],
                                eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                                **QWEN3_30B_A3B_LAYER)
        config.architectures = ["Qwen3MoeForCausalLM"]
        log(f"checkpoint {d.name}: building {n_layers}-layer model (seed {seed}, bf16)")
        torch.manual_seed(seed)
        t0 = time.time()
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
        model.eval()
        n_params = sum(p.numel() for p in model.parameters())
        log(f"  {n_params / 1e9:.3f} B params in {time.time() - t0:.0f} s; saving")
        model.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)
        del model
        (d / ".complete").write_text(json.dumps({"params": n_params, "seed": seed}) + "\n")
    return out


# ----------------------------------------------------------------------------------------------------- step 4


def gguf_path(work: Path, layers: int, fmt: str) -> Path:
    return work / "gguf" / f"qwen3moe-a3b-geom-{layers}L-{fmt}.gguf"


def convert(work: Path = DEFAULT_WORK, checkpoints: dict[int, Path] | None = None,
            formats: Sequence[str] = FORMATS) -> list[dict]:
    """HF -> GGUF bf16 / Q8_0 with the sdist's converter, bf16 -> Q4_K_M with llama-quantize. Returns model records."""
    llama_dir = fetch_source(work)
    if checkpoints is None:
        checkpoints = make_checkpoints(work)
    (work / "gguf").mkdir(parents=True, exist_ok=True)
    quantize = binaries(work)["llama-quantize"]
    records = []
    for n_layers, hf_dir in sorted(checkpoints.items()):
        # bf16 first: Q4_K_M is quantised from it
        for fmt in sorted(formats, key=lambda f: f != "bf16"):
            path = gguf_path(work, n_layers, fmt)
            if not path.exists():
                tmp = path.with_name(path.name + ".part")
                logf = work / "gguf" / f"{path.stem}.log"
                if fmt in ("bf16", "q8_0"):
                    _run([sys.executable, "-c", _CONVERT_WRAPPER, llama_dir, _expected_pretok(), hf_dir,
                          "--outtype", fmt, "--outfile", tmp], cwd=llama_dir, nice=10, log_path=logf)
                elif fmt == "q4_k_m":
                    src = gguf_path(work, n_layers, "bf16")
                    if not src.exists():
                        raise RuntimeError(f"{src} missing: Q4_K_M is quantised from the bf16 GGUF")
                    _run([quantize, src, tmp, "Q4_K_M", str(os.cpu_count() or 1)], nice=10, log_path=logf)
                else:
                    raise ValueError(f"unknown format {fmt!r}")
                tmp.replace(path)
            records.append({"name": path.stem, "layers": n_layers, "format": fmt, "path": str(path),
                            "file_bytes": path.stat().st_size, **gguf_tensor_types(path)})
    return records


def gguf_tensor_types(path: Path) -> dict:
    """Tensor types in a GGUF: {type: {"tensors", "bytes"}} and per tensor kind (block index folded to '*')."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    counts: Counter = Counter()
    nbytes: Counter = Counter()
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for t in reader.tensors:
        ty = t.tensor_type.name
        counts[ty] += 1
        nbytes[ty] += int(t.n_bytes)
        by_kind[re.sub(r"^blk\.\d+\.", "blk.*.", t.name)][ty] += 1
    meta = {}
    arch_field = reader.get_field("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "?"
    for key, field in reader.fields.items():
        if key in ("general.architecture", "general.file_type", "tokenizer.ggml.pre", "tokenizer.ggml.model") or \
                key.startswith(f"{arch}."):
            meta[key] = field.contents()
    return {"tensor_types": {k: {"tensors": counts[k], "bytes": nbytes[k]} for k in sorted(counts)},
            "tensor_types_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "gguf_meta": meta}


# ----------------------------------------------------------------------------------------------------- step 5/6


def run_llama_bench(gguf_path: str | Path, extra_args: Sequence[str] = (), threads: int | Sequence[int] = 2,
                    n_gen: int = 16, *, reps: int = 3, binary: str | Path | None = None, work: Path = DEFAULT_WORK,
                    timeout: float = 1800) -> dict:
    """Run `llama-bench -m FILE -p 0 -n n_gen -t threads -r reps -o json <extra_args>` and parse its JSON.

    `threads` may be a list (llama-bench's comma syntax: one test per value); `extra_args` are passed through
    verbatim, after ours, exactly as a user would type them (e.g. ["-ngl", "0"], ["--n-cpu-moe", "2"],
    ["-ot", "exps=CPU"], ["-fa", "1"], ["-d", "0,1024"]). Which of these the CPU build accepts is listed in the
    module docstring (summary: -ngl, --n-cpu-moe, -ot ...=CPU, -fa, -ts a/b are accepted; -ot ...=CUDA0 and
    --cpu-moe are refused; "-ts 1,1" is accepted but means two tests, since "," separates test values).

    Returns {"ok": True, "cmd", "wall_s", "rows": [{"threads", "depth", "n_gen", "tps_mean", "tps_std", "runs",
    "samples_tps", ...}], "raw": llama-bench's JSON} or {"ok": False, "cmd", "returncode", "stderr_tail",
    "stdout_tail", "error"}. Never raises for a failing llama-bench.
    """
    binary = Path(binary) if binary else binaries(work)["llama-bench"]
    tlist = [threads] if isinstance(threads, int) else list(threads)
    extra = [str(a) for a in extra_args]
    # llama-bench *adds* a test per repeated list flag ("-t 2 -t 4" = two tests), so a default is left out when
    # the caller's extra_args set that flag themselves; -r and -o are single-valued (last one wins) and stay.
    cmd = [str(binary), "-m", str(gguf_path)]
    for flags, value in ((("-p", "--n-prompt"), "0"), (("-n", "--n-gen"), str(n_gen)),
                         (("-t", "--threads"), ",".join(map(str, tlist)))):
        if not any(a in flags for a in extra):
            cmd += [flags[0], value]
    cmd += ["-r", str(reps), "-o", "json", *extra]
    t0, cpu0, child0, load0 = time.time(), _cpu_busy_s(), _children_cpu_s(), os.getloadavg()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "cmd": cmd, "returncode": None, "error": f"{type(e).__name__}: {e}",
                "stderr_tail": "", "stdout_tail": ""}
    wall = time.time() - t0
    others = (_cpu_busy_s() - cpu0) - (_children_cpu_s() - child0)
    fail = {"ok": False, "cmd": cmd, "returncode": proc.returncode, "wall_s": round(wall, 2),
            "loadavg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
            "others_cpu_frac": round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3),
            "stderr_tail": proc.stderr[-2000:], "stdout_tail": proc.stdout[-2000:],
            "error_lines": [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines()
                            if re.search(r"\berror\b|failed|invalid|unrecognized|unknown", ln, re.I)][:8]}
    if proc.returncode != 0:
        return {**fail, "error": f"llama-bench exited with {proc.returncode}"}
    try:
        raw = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        return {**fail, "error": f"unparseable JSON on stdout: {e}"}
    if not isinstance(raw, list) or not raw:
        return {**fail, "error": "llama-bench printed no result rows"}
    rows = []
    for r in raw:
        samples = [float(x) for x in r.get("samples_ts", [])]
        rows.append({"threads": r.get("n_threads"), "depth": r.get("n_depth", 0), "n_gen": r.get("n_gen"),
                     "tps_mean": r.get("avg_ts"), "tps_std": r.get("stddev_ts"), "runs": len(samples),
                     "samples_tps": samples, "n_gpu_layers": r.get("n_gpu_layers"), "n_cpu_moe": r.get("n_cpu_moe"),
                     "flash_attn": r.get("flash_attn"), "tensor_split": r.get("tensor_split"),
                     "override_tensors": r.get("tensor_buft_overrides")})
    return {"ok": True, "cmd": cmd, "wall_s": fail["wall_s"], "others_cpu_frac": fail["others_cpu_frac"],
            "loadavg_1m": fail["loadavg_1m"], "rows": rows, "raw": raw}


def _cpu_busy_s() -> float:
    """Machine-wide busy CPU seconds so far (all cores, /proc/stat), or 0.0 where /proc/stat is missing."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    busy = sum(f[:8]) - idle  # user nice system idle iowait irq softirq steal; guest is inside user
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_for_idle(max_wait_s: float = 180, threads: int = 0, window_s: float = 5) -> dict:
    """Wait until `threads` more busy threads would fit on this shared machine's cores (over a window_s sample).

    Returns {"waited_s", "busy_frac"}: the last window's machine-wide busy fraction; after max_wait_s it gives
    up and the caller measures anyway (the row then records how contended it was).
    """
    t0 = time.time()
    ncpu = os.cpu_count() or 1
    while True:
        b0 = _cpu_busy_s()
        time.sleep(window_s)
        frac = (_cpu_busy_s() - b0) / (window_s * ncpu)
        waited = time.time() - t0
        if frac * ncpu + threads - ncpu <= MAX_OVERSUB / 2 or waited >= max_wait_s:
            return {"waited_s": round(waited, 1), "busy_frac": round(frac, 3)}


def oversubscription(res: dict) -> float:
    """Cores by which other processes' CPU use plus the run's own threads exceeded this machine's cores."""
    ncpu = os.cpu_count() or 1
    threads = max(r["threads"] or 1 for r in res["rows"])
    return max(0.0, res["others_cpu_frac"] * ncpu + threads - ncpu)


def _cv(res: dict) -> float:
    return max((r["tps_std"] or 0) / r["tps_mean"] if r["tps_mean"] else 1.0 for r in res["rows"])


def _score(res: dict) -> float:
    """Contention score of a run (lower is cleaner): oversubscribed cores + the samples' std/mean."""
    return oversubscription(res) + _cv(res)


def _contended(res: dict) -> bool:
    return oversubscription(res) > MAX_OVERSUB or _cv(res) > MAX_CV


def reference_loop(n: int = 2_000_000) -> float:
    """Seconds for n pure-Python float multiply-adds: a crude, portable machine-speed yardstick."""
    x, a, b = 0.0, 1.000000001, 1e-9
    t0 = time.perf_counter()
    for _ in range(n):
        x = x * a + b
    dt = time.perf_counter() - t0
    assert x > 0
    return round(dt, 4)


def machine_info() -> dict:
    lscpu: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            k, _, v = line.partition(":")
            lscpu[k.strip()] = v.strip()

    def _int(key: str) -> int | None:
        try:
            return int(lscpu[key])
        except (KeyError, ValueError):
            return None

    cores = (_int("Core(s) per socket") or 0) * (_int("Socket(s)") or 0) or None
    flags = set(lscpu.get("Flags", "").split())
    mem = None
    with contextlib.suppress(ValueError, OSError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cpu_model": lscpu.get("Model name"), "cores": cores, "threads_per_core": _int("Thread(s) per core"),
            "nproc": int(_first_line(["nproc"]) or 0) or None, "cpu_count": os.cpu_count(),
            "l3": lscpu.get("L3 cache"), "hypervisor": lscpu.get("Hypervisor vendor"),
            "simd": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
            "mem_gib": mem, "platform": platform.platform(), "python": platform.python_version()}


def bench_quiet(gguf: str | Path, extra_args: Sequence[str], *, idle_wait_s: float = 180, attempts: int = 3,
                **kw) -> dict:
    """run_llama_bench() after wait_for_idle(), retried while the run looks contended (see _contended).

    On 2 shared cores one busy neighbour cuts llama.cpp's 2-thread decode rate up to 25-fold (its threads sync
    at every op), so a run where other processes' CPU use plus its own threads exceeded the cores by more than
    MAX_OVERSUB, or whose samples spread by more than MAX_CV (std/mean), is repeated; the attempt with the lowest
    _score is returned, with "attempts" (how many were made) and "idle_wait".
    """
    threads = kw.get("threads", 2)
    tmax = threads if isinstance(threads, int) else max(threads)
    best = None
    for i in range(attempts):
        idle = wait_for_idle(idle_wait_s, threads=tmax)
        res = {**run_llama_bench(gguf, extra_args, **kw), "idle_wait": idle}
        if not res["ok"]:
            return {**res, "attempts": i + 1}
        if best is None or _score(res) < _score(best):
            best = res
        if not _contended(res):
            break
        log(f"  contended run (others took {res['others_cpu_frac']:.0%} of the CPUs, cv {_cv(res):.0%})"
            + (": retrying" if i + 1 < attempts else ""))
    return {**best, "attempts": i + 1}


def measure(work: Path = DEFAULT_WORK, models: Sequence[dict] | None = None, threads: Sequence[int] = THREADS,
            depths: Sequence[int] = DEPTHS, n_gen: int = N_GEN, reps: int = REPS, remeasure: bool = False,
            deadline_min: float = 30, max_attempts: int = 4, host_profile: bool = True, offline: bool = False) -> dict:
    """Decode tok/s for every model x threads x depth; each row cached in work/results/.

    One llama-bench process per (file, threads, depth). Others share this machine, and a busy neighbour cuts
    llama.cpp's decode rate many-fold, so rows are measured politely: the pending rows are visited in turn, each
    is run only when wait_for_idle() (up to 30 s) finds room for its threads, and is done once a run is not
    _contended (or after max_attempts runs; the cleanest run is kept). A t=1 row thus fits in a half-busy machine
    while a t=2 row waits for an idle one. After deadline_min minutes the rows never measured are run anyway;
    rows left contended are flagged, and a later invocation retries them.
    Returns {"rows", "bench_build", "reference_loop_s": [before, after], "loadavg": [before, after],
    "host_profiles": {"before", "after"}}: the reference loop and this machine's host profile as `moesim profile
    --hardware` measures it (predict_llamacpp.measure_host_profile) bracket the llama-bench runs of the latest
    invocation that ran any, so the prediction sees the contention the rows saw. Rows are cached per settings
    (n_gen, reps): a --quick run does not overwrite the full run's rows.
    """
    import predict_llamacpp as pl

    if models is None:
        models = convert(work)
    settings = {"n_gen": n_gen, "reps": reps}
    resdir = work / ("results" if (n_gen, reps) == (N_GEN, REPS) else f"results-n{n_gen}-r{reps}")
    resdir.mkdir(parents=True, exist_ok=True)
    ref_cache = resdir / "reference_loop.json"
    grid = [(m, t, d) for m in models for t in threads for d in depths]

    def cache_of(m: dict, t: int, d: int) -> Path:
        return resdir / f"{m['name']}-t{t}-d{d}.json"

    def load(m: dict, t: int, d: int) -> dict | None:
        c = cache_of(m, t, d)
        if remeasure or not c.exists():
            return None
        obj = json.loads(c.read_text())
        return obj["res"] if obj.get("settings") == settings else None

    pending = [(m, t, d) for m, t, d in grid if (old := load(m, t, d)) is None or _contended(old)]
    if offline:  # predict from what is cached: run nothing, leave out rows never measured
        grid = [(m, t, d) for m, t, d in grid if load(m, t, d) is not None]
        pending = []
    remeasure = False  # from here on load() sees what this call wrote
    tried = Counter()
    t_end = time.time() + deadline_min * 60
    ref = None
    if pending:
        ref = {"reference_loop_s": [reference_loop()], "loadavg": [list(os.getloadavg())], "host_profiles": {}}
        if host_profile:
            log("measuring this machine's host profile (measure_host, as `moesim profile --hardware`) before the rows")
            ref["host_profiles"]["before"] = {"idle_wait": wait_for_idle(120, threads=os.cpu_count() or 1),
                                              **pl.measure_host_profile(resdir, "before")}
    while pending:
        late = time.time() > t_end
        for key in list(pending):
            m, t, d = key
            old = load(m, t, d)
            if tried[m["name"], t, d] >= max_attempts or (late and old is not None):
                pending.remove(key)
                continue
            idle = wait_for_idle(30, threads=t)
            if idle["busy_frac"] * (os.cpu_count() or 1) + t - (os.cpu_count() or 1) > MAX_OVERSUB / 2 and not late:
                continue
            res = {**run_llama_bench(m["path"], ["-d", str(d)], threads=t, n_gen=n_gen, reps=reps, work=work),
                   "idle_wait": idle}
            if not res["ok"]:
                raise RuntimeError(f"llama-bench failed for {m['name']}: {json.dumps(res, indent=1)}")
            tried[m["name"], t, d] += 1
            res["attempts"] = (old or {}).get("attempts", 0) + 1
            (r,) = res["rows"]
            log(f"{m['name']} t={t} d={d}: {r['tps_mean']:.2f} +- {r['tps_std']:.2f} tok/s (others took "
                f"{res['others_cpu_frac']:.0%} of the CPUs{', contended' if _contended(res) else ''}; "
                f"attempt {res['attempts']}; {len(pending) - 1} rows pending)")
            if old is not None and _score(old) <= _score(res):
                res = {**old, "attempts": res["attempts"]}
            _write_json(cache_of(m, t, d), {"settings": settings, "res": res})
            if not _contended(res):
                pending.remove(key)
    if ref is not None:
        ref["reference_loop_s"].append(reference_loop())
        ref["loadavg"].append(list(os.getloadavg()))
        if host_profile:
            log("measuring this machine's host profile after the rows")
            ref["host_profiles"]["after"] = {"idle_wait": wait_for_idle(120, threads=os.cpu_count() or 1),
                                             **pl.measure_host_profile(resdir, "after")}
        _write_json(ref_cache, ref)
    ref = json.loads(ref_cache.read_text()) if ref_cache.exists() else {"reference_loop_s": [], "loadavg": []}
    rows, raw0 = [], None
    for m, t, d in grid:
        res = load(m, t, d)
        raw0 = raw0 or res["raw"][0]
        rows.append(bench_row(m, res))
    bench_build = {k: raw0.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "type_k",
                                            "type_v", "n_batch", "n_ubatch", "flash_attn", "repack", "load_mode",
                                            "split_mode")} if raw0 else {}
    return {"rows": rows, "bench_build": bench_build, "host_profiles": {}, **ref}


def bench_row(model: dict, res: dict) -> dict:
    """One result row from a model record and its cached run_llama_bench() result (one test): the measured
    decode speed as median / min / max / mean over the reps, how contended the run was, its load average."""
    (r,) = res["rows"]
    samples = [float(x) for x in r["samples_tps"]]
    return {"file": Path(model["path"]).name, "model": model["name"], "path": model["path"], "layers": model["layers"],
            "format": model["format"], "threads": r["threads"], "depth": r["depth"], "n_gen": r["n_gen"],
            "measured_tok_s": round(statistics.median(samples), 3) if samples else r["tps_mean"],
            "measured_min": round(min(samples), 3) if samples else None,
            "measured_max": round(max(samples), 3) if samples else None,
            "tps_mean": round(r["tps_mean"], 3), "tps_std": round(r["tps_std"], 3), "runs": r["runs"],
            "samples_tps": [round(x, 3) for x in samples], "others_cpu_frac": res["others_cpu_frac"],
            "loadavg_1m": res.get("loadavg_1m"), "attempts": res.get("attempts"), "contended": _contended(res)}


EXTRA_ARG_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("-ngl", "0"),
    ("-ngl", "99"),
    ("--n-cpu-moe", "1"),
    ("-ncmoe", "1"),
    ("-ot", "ffn_.*_exps=CPU"),
    ("-ot", "exps=CPU"),
    ("-fa", "1"),
    ("-ts", "1/1"),
    ("-ts", "1,1"),
    ("-ngl", "99", "--n-cpu-moe", "1", "-fa", "1"),
    ("-ot", "exps=CUDA0"),
    ("--cpu-moe",),
    ("-cmoe",),
)


def check_extra_args(work: Path = DEFAULT_WORK, model: Path | None = None, arg_sets=EXTRA_ARG_SETS,
                     redo: bool = False, offline: bool = False) -> list[dict]:
    """Which user-style extra arguments this llama-bench accepts (2-layer Q4_K_M, t=2, 16 tokens x 3). Cached."""
    cache = work / "results" / "extra_args.json"
    if cache.exists() and not redo:
        done = json.loads(cache.read_text())
        if [tuple(d["extra_args"]) for d in done] == [tuple(a) for a in arg_sets] or offline:
            return done
    if offline:
        return []
    model = model or gguf_path(work, min(LAYERS), "q4_k_m")
    out = []
    for args in arg_sets:
        res = bench_quiet(model, list(args), idle_wait_s=20, attempts=1, threads=2, n_gen=16, reps=3, work=work)
        entry = {"extra_args": list(args), "accepted": res["ok"]}
        if res["ok"]:
            entry["tests"] = len(res["rows"])
            entry["tps"] = [round(r["tps_mean"], 2) for r in res["rows"]]
            entry["others_cpu_frac"] = res["others_cpu_frac"]
            entry["reported"] = {k: res["rows"][0][k] for k in ("n_gpu_layers", "n_cpu_moe", "flash_attn",
                                                                 "tensor_split", "override_tensors")}
        else:
            entry["returncode"] = res["returncode"]
            entry["message"] = res.get("error_lines") or (res["stderr_tail"] + res["stdout_tail"]).splitlines()[-3:]
        log(f"extra args {' '.join(args) or '(none)'}: {'accepted' if res['ok'] else 'REFUSED'} "
            f"{entry.get('tps', entry.get('message'))}")
        out.append(entry)
    cache.parent.mkdir(parents=True, exist_ok=True)
    _write_json(cache, out)
    return out


def engine_arg_deployments(spec) -> list[tuple[str, object]]:
    """The deployments whose llama.cpp arguments moesim prints, for the tiny GGUF's spec: (what, Layout)."""
    from moesim.layout import make_layout

    m = spec.n_moe_layers
    return [
        ("all-CPU (--hw none): every layer on the CPU", make_layout(spec, 0)),
        ("all-resident on one GPU", make_layout(spec, 1)),
        (f"cpu-static: the first 1 of {m} MoE layers' experts on the CPU", make_layout(spec, 1, cpu_moe_layers=1)),
        (f"cpu-static: all {m} MoE layers' experts on the CPU", make_layout(spec, 1, cpu_moe_layers=m)),
        (f"gpu-layers: the last 1 of {spec.n_layers} layers on one GPU", make_layout(spec, 1, gpu_layers=1)),
        ("two GPUs, layer split, the first MoE layer's experts on the CPU", make_layout(spec, 2, cpu_moe_layers=1)),
        ("two GPUs, layer split", make_layout(spec, 2)),
        ("two GPUs, tensor split (row)", make_layout(spec, 2, split="tensor")),
    ]


def _strip_model(args: Sequence[str]) -> list[str]:
    """An invocation's arguments without the program and its -m FILE (run_llama_bench adds its own)."""
    out, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
        elif a == "-m":
            skip = True
        else:
            out.append(a)
    return out


def check_engine_args(work: Path = DEFAULT_WORK, model: Path | None = None, threads: int = 2, context: int = 4096,
                      redo: bool = False, offline: bool = False) -> list[dict]:
    """Run the llama.cpp arguments moesim prints (moesim.engine_args.invocation, as the deployment answer calls
    it) for each deployment of engine_arg_deployments() through llama-bench on the tiny GGUF (2-layer Q4_K_M,
    16 tokens x 3): the llama-bench form (program="llama-bench"), the override-tensor (-ot) spelling from the
    note where there is one, and the llama-server form verbatim where it differs (to record what llama-bench
    refuses). Each entry: deployment, printed (server) line, llama-bench arguments, note, ok, tests, tok/s, what
    llama-bench reported back (n_gpu_layers, n_cpu_moe, tensor_split, override_tensors) or the error. Cached."""
    from moesim.engine_args import cpu_moe_override, invocation
    from moesim.gguf_file import spec_from_gguf

    model = Path(model or gguf_path(work, min(LAYERS), "q4_k_m"))
    spec = spec_from_gguf(model)
    plan = []
    for what, layout in engine_arg_deployments(spec):
        server = invocation("llama.cpp", spec, layout, threads=threads, context=context, model_path=model.name)
        bench = invocation("llama.cpp", spec, layout, threads=threads, context=context, model_path=model.name,
                           program="llama-bench")
        plan.append({"deployment": what, "form": "llama-bench", "printed": server.line(), "note": bench.note,
                     "args": _strip_model(bench.args)})
        ot = cpu_moe_override(spec, layout)
        if ot is not None:
            a = _strip_model(bench.args)
            i = a.index("--n-cpu-moe")
            plan.append({"deployment": what, "form": "llama-bench, -ot spelling from the note", "printed": server.line(),
                         "note": bench.note, "args": a[:i] + ["-ot", ot] + a[i + 2:]})
        if _strip_model(server.args) != _strip_model(bench.args):
            plan.append({"deployment": what, "form": "llama-server spelling, verbatim", "printed": server.line(),
                         "note": "", "args": _strip_model(server.args)})
    cache = work / "results" / "engine_args.json"
    if cache.exists() and not redo:
        done = json.loads(cache.read_text())
        if [(d["deployment"], d["form"], d["args"]) for d in done] == [(d["deployment"], d["form"], d["args"])
                                                                         for d in plan] or offline:
            return done
    if offline:
        return []
    out = []
    for entry in plan:
        if entry["form"].endswith("verbatim"):  # expected to be refused at once: no wait for an idle machine
            res = run_llama_bench(model, entry["args"], threads=threads, n_gen=16, reps=3, work=work)
        else:
            res = bench_quiet(model, entry["args"], idle_wait_s=30, attempts=1, threads=threads, n_gen=16, reps=3,
                              work=work)
        e = {**entry, "ok": res["ok"], "cmd": [Path(res["cmd"][0]).name, *res["cmd"][1:]]}
        if res["ok"]:
            e["tests"] = len(res["rows"])
            e["tps"] = [round(r["tps_mean"], 2) for r in res["rows"]]
            e["others_cpu_frac"] = res["others_cpu_frac"]
            e["reported"] = {k: res["rows"][0][k] for k in ("n_gpu_layers", "n_cpu_moe", "tensor_split",
                                                             "override_tensors")}
            e["reported"]["split_mode"] = res["raw"][0].get("split_mode")
        else:
            e["returncode"] = res["returncode"]
            e["message"] = res.get("error_lines") or (res["stderr_tail"] + res["stdout_tail"]).splitlines()[-3:]
        log(f"engine args [{entry['form']}] {' '.join(entry['args'])}: {'ran' if res['ok'] else 'FAILED'} "
            f"{e.get('tps', e.get('message'))}")
        out.append(e)
    cache.parent.mkdir(parents=True, exist_ok=True)
    _write_json(cache, out)
    return out


# ----------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="work dir for source, build, models, caches")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="result JSON (default bench/llamacpp.json)")
    ap.add_argument("--readme", type=Path, default=DEFAULT_README, help="README subsection written from the JSON")
    ap.add_argument("--readme-only", action="store_true", help="only regenerate --readme from --out; run nothing")
    ap.add_argument("--skip-build", action="store_true", help="do not build; require existing binaries")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    ap.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    ap.add_argument("--n-gen", type=int, default=N_GEN)
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--quick", action="store_true",
                    help="-n 16 -r 3 (cached apart from the full settings' rows): a few minutes on an idle machine")
    ap.add_argument("--remeasure", action="store_true",
                    help="re-run llama-bench for every row, the host profile and the argument checks, even if cached")
    ap.add_argument("--deadline-min", type=float, default=30,
                    help="minutes to keep waiting for an idle machine before measuring the remaining rows anyway")
    ap.add_argument("--fit-layers", type=int, default=2,
                    help="fit llama.cpp's cpu_weight_efficiency and cpu_kernel_gmacs on these files' uncontended rows (reported as "
                         "fitted; the other files are the holdout); 0 = no fit")
    ap.add_argument("--skip-arg-checks", action="store_true",
                    help="do not run the argument checks (their cached results are reported)")
    ap.add_argument("--offline", action="store_true",
                    help="run no llama-bench: rows, host profiles and argument checks from the caches only (rows never "
                         "measured are left out; contended ones are not retried)")
    args = ap.parse_args(argv)
    if args.readme_only:
        result = json.loads(args.out.read_text())
        write_readme(result, args.readme)
        log(f"wrote {args.readme}")
        return result
    if args.quick:
        args.n_gen, args.reps = 16, 3
    import importlib.util

    if importlib.util.find_spec("gguf") is None:  # moesim reads the GGUF files' bytes and tensor types through it
        sys.exit('this benchmark needs gguf-py, which is not installed: pip install ".[gguf]"')
    work = args.work.expanduser().resolve()

    llama_dir = fetch_source(work)
    if args.skip_build:
        missing = [str(p) for p in binaries(work).values() if not p.exists()]
        if missing:
            sys.exit(f"--skip-build but missing: {missing}")
        stamp = work / "build_info.json"
        build_info = json.loads(stamp.read_text()) if stamp.exists() else {}
    else:
        build_info = build(work, jobs=args.jobs)
    # HF checkpoints only for GGUFs not yet converted (they may be deleted once converted)
    need = [n for n in args.layers if not all(gguf_path(work, n, f).exists() for f in args.formats)]
    ckpts = {n: checkpoint_dir(work, n) for n in args.layers} | (make_checkpoints(work, need) if need else {})
    models = convert(work, ckpts, args.formats)
    meas = measure(work, models, args.threads, args.depths, args.n_gen, args.reps, remeasure=args.remeasure,
                   deadline_min=args.deadline_min, offline=args.offline)
    # --skip-arg-checks: run none, report the cached ones
    no_run = args.offline or args.skip_arg_checks
    engine_checks = check_engine_args(work, redo=args.remeasure and not no_run, offline=no_run)
    checks = check_extra_args(work, redo=args.remeasure and not no_run, offline=no_run)

    import predict_llamacpp as pl

    hosts = meas["host_profiles"]
    if not hosts.get("before"):
        log("no host profile cached with these rows: measuring it now (not bracketing the rows)")
        hosts = {"before": pl.measure_host_profile(work / "results", "now"), "after": None, "not_bracketing": True}
    pred = pl.predict_rows(meas["rows"], hosts, args.n_gen, fit_layers=args.fit_layers or None)

    info = llama_cpp_info(llama_dir)
    info.update({k: meas["bench_build"].get(k) for k in ("build_commit", "build_number")})
    info["build"] = {k: build_info.get(k) for k in ("configure_s", "build_s", "jobs", "incremental", "cmake_flags",
                                                         "compiler")}
    machine = machine_info()
    machine["loadavg_before_after"] = meas["loadavg"]
    machine["llama_bench_cpu_info"] = meas["bench_build"].get("cpu_info")
    result = {
        "what": "llama-bench decode (tg) on tiny synthetic (random-weight) MoE checkpoints with Qwen3-30B-A3B's layer "
                "geometry, against moesim's prediction for the all-CPU deployment (--hw none) on this machine's "
                "measured host profile and the llama.cpp engine profile",
        "rerun": "python bench/bench_llamacpp.py --skip-build --remeasure",
        "machine": machine,
        "llama_cpp": info,
        "reference_loop_s": meas["reference_loop_s"],
        "host_profiles": {k: v for k, v in hosts.items()},
        "host_profile_used": pred["host_used"],
        "prediction": {"engine": pl.ENGINE, "path": "moesim.sim.static.simulate_static(synthetic_trace(spec_from_gguf"
                       "(FILE), prompt_len=max(depth, 1), tokens=n_gen), 'none', 'all-resident', host=HOST, "
                       "engine='llama.cpp', threads=T)", "variants": {
                           "profile": "host profile as `moesim profile --hardware` measures it (measure_host)",
                           "profile_fp32": "the same, compute rate = fp32 GEMM measured beside it (not fitted)",
                           "fitted": "profile_fp32 with llama.cpp's cpu_weight_efficiency.default and cpu_kernel_gmacs FITTED on the "
                                     f"{args.fit_layers}-layer rows; the other rows are the holdout"}},
        "settings": {"n_gen": args.n_gen, "reps": args.reps, "n_prompt": 0, "threads": args.threads,
                     "depths": args.depths, "seed": SEED, "vocab_size": VOCAB_SIZE,
                     "geometry": "Qwen3-30B-A3B per layer: " + json.dumps(QWEN3_30B_A3B_LAYER),
                     **{k: meas["bench_build"].get(k) for k in ("type_k", "type_v", "n_batch", "n_ubatch",
                                                                "flash_attn", "repack", "load_mode", "backends")}},
        "models": [{k: m[k] for k in ("name", "layers", "format", "file_bytes", "tensor_types",
                                      "tensor_types_by_kind", "gguf_meta")} for m in models],
        "summary": pred["summary"],
        "fit": pred["fit"],
        "rows": [{k: v for k, v in r.items() if k != "path"} for r in pred["rows"]],
        "engine_args_checks": engine_checks,
        "extra_args_checks": checks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(args.out, result)
    log(f"wrote {args.out}")
    write_readme(result, args.readme)
    log(f"wrote {args.readme}")
    print("\n" + rows_table(result))
    return result


# ----------------------------------------------------------------------------------------------------- README


def _fmt(x, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def rows_table(result: dict) -> str:
    """The markdown table of measured vs predicted rows."""
    fitted = any("ratio_fitted" in r for r in result["rows"])
    head = ["file", "threads", "depth", "measured tok/s (median, min-max)", "predicted (profile)", "ratio",
            "predicted (fp32 rate)", "ratio"] + (["fitted", "ratio", "split"] if fitted else []) + \
        ["others' CPU", "load 1m", "contended"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["file"].removesuffix(".gguf"), str(r["threads"]), str(r["depth"]),
                 f"{_fmt(r['measured_tok_s'])} ({_fmt(r['measured_min'])}-{_fmt(r['measured_max'])})",
                 _fmt(r["predicted_tok_s"]), _fmt(r["ratio"], 2), _fmt(r["predicted_tok_s_fp32"]),
                 _fmt(r["ratio_fp32"], 2)]
        if fitted:
            cells += [_fmt(r.get("predicted_tok_s_fitted")), _fmt(r.get("ratio_fitted"), 2), r.get("split", "-")]
        load = r.get("loadavg_1m")
        cells += [f"{r['others_cpu_frac']:.0%}", "-" if not load else "/".join(f"{x:.1f}" for x in load),
                  "yes" if r["contended"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stat_line(name: str, st: dict) -> str:
    a, c = st["all"], st["uncontended"]

    def one(x: dict) -> str:
        if not x.get("n"):
            return "no rows"
        return (f"{x['within_15']}/{x['n']} within +-15%, median ratio {x['median_ratio']}, median |ln| "
                f"{x['median_abs_ln']}, worst {x['worst_ratio']}")
    return f"- {name}: all rows {one(a)}; uncontended rows {one(c)}."


def write_readme(result: dict, path: Path = DEFAULT_README) -> None:
    """The proposed README subsection "### llama.cpp on this machine", generated from llamacpp.json."""
    m, info, s = result["machine"], result["llama_cpp"], result["settings"]
    used = result.get("host_profile_used", "before")
    hb = (result.get("host_profiles") or {}).get(used) or {}
    ha = (result.get("host_profiles") or {}).get("after" if used == "before" else "before") or {}
    rows = result["rows"]
    n_cont = sum(r["contended"] for r in rows)
    summ = result["summary"]
    fit = result.get("fit") or {}
    ok_p = all(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    lines = [
        "### llama.cpp on this machine",
        "",
        f"`bench/bench_llamacpp.py` builds llama.cpp's CPU backend from the `{info.get('sdist')}` sdist (llama.cpp "
        f"{str(info.get('commit') or '?')[:9]}, build {info.get('build_number')}), makes tiny **synthetic** "
        "(seeded random weights) Qwen3-MoE checkpoints with Qwen3-30B-A3B's layer geometry (hidden 2048, 128 experts "
        "of 768, top-8, 32/4 heads of 128) and "
        + " and ".join(sorted({str(r["layers"]) for r in rows})) + " layers, a 1k-token BPE vocabulary, converts "
        "them with llama.cpp's own converter to GGUF bf16 and Q8_0 and with llama-quantize to Q4_K_M, and measures "
        f"batch-1 decode with `llama-bench -p 0 -n {s['n_gen']} -r {s['reps']} -d DEPTH -t THREADS`. Each row is "
        "compared with moesim's prediction for the all-CPU deployment (`--hw none`, all-resident) of the same GGUF "
        "file (`spec_from_gguf`), on this machine's host profile as `moesim profile --hardware` measures it "
        "(measure_host, run right before and after the llama-bench rows so both see the same contention) and the "
        "`llama.cpp` engine profile, on a synthetic trace whose prompt is the row's depth.",
        "",
        f"Machine: {m.get('cpu_model')} ({m.get('hypervisor') or 'no'} hypervisor), {m.get('nproc')} cores shared "
        f"with other jobs, SIMD {', '.join(m.get('simd') or [])}"
        f"{'' if any(x.startswith('avx512') for x in m.get('simd') or []) else ' (no AVX512)'}, {m.get('mem_gib')} GiB; "
        + (f"pure-Python reference loop {'/'.join(str(x) for x in result['reference_loop_s'])} s (before/after "
           "the rows; for comparing machines). " if result.get("reference_loop_s") else "")
        + (f"Host profile used, measured {used} the rows" if not (result.get("host_profiles") or {}).get(
            "not_bracketing") else "Host profile (measured after the rows, not bracketing them)")
        + (f" ({hb['when']}, other processes {hb.get('others_cpu_frac', float('nan')):.0%} of the CPUs; the "
           "bracketing profile measured with the least contention, as the rows wait for an idle machine): "
           f"memory {hb['figures']['mem_bw_achievable_gbs']:g} GB/s ({hb['figures']['mem_bw_per_core_gbs']:g} on one "
           f"core), bf16 GEMM {hb['figures']['bf16_tflops'] * 1e3:.2g} GFLOP/s, fp32 GEMM "
           f"{hb['fp32_gemm_tflops'] * 1e3:.3g} GFLOP/s, expert dispatch {hb['figures']['expert_dispatch_us']:g} us"
           if hb else ": none recorded")
        + (f"; the other one ({ha['when']}, others {ha.get('others_cpu_frac', float('nan')):.0%}): memory "
           f"{ha['figures']['mem_bw_achievable_gbs']:g} GB/s, fp32 GEMM {ha['fp32_gemm_tflops'] * 1e3:.3g} GFLOP/s"
           if ha else "") + ".",
        "",
        "The prediction is what `moesim whatif --model FILE.gguf --hw none --policy all-resident --host HOST.toml "
        f"--engine llama.cpp --threads T --prompt-len D --tokens {s['n_gen']}` computes: every row was also predicted "
        "through that command's library call (moesim.sim.whatif.whatif) and "
        + ("agrees" if result["summary"].get("whatif_agrees") else "DISAGREES (see whatif_tok_s in the JSON)")
        + ".",
        "",
        rows_table(result),
        "",
        "Columns: *profile* is the prediction with the host profile exactly as measured; *fp32 rate* replaces only "
        "its compute rate by an fp32 GEMM measured beside it (see below; measured, not fitted)"
        + ("; *fitted* adds llama.cpp's "
           + ", ".join(f"`{k}` = {v:g}" for k, v in (fit.get("figures") or {}).items())
           + f" (one share of the bandwidth, and the G multiply-adds a second one thread's kernels reach per "
           f"format: docs/engine-format.md), **fitted** by least squares on the uncontended "
           f"{fit.get('fit_layers')}-layer rows ({fit.get('fit_rows')} rows: 1 and 2 threads, both depths) and "
           "reported on the others (holdout). The fitted values are this benchmark's only; "
           "hwprofiles/engines/llama.cpp.toml is unchanged" if fit.get("value") else "")
        + f". *contended*: other processes' CPU use plus the run's threads exceeded the cores by more than "
        f"{MAX_OVERSUB} or the reps' std/mean exceeded {MAX_CV:.0%} ({n_cont} of {len(rows)} rows). So a 1-thread "
        "row counts as uncontended while another job keeps the other core busy (*others' CPU* ~50%): most 1-thread "
        "rows here were measured so, sharing memory bandwidth and the L3 with that job; a 2-thread row only on an "
        "otherwise idle machine.",
        "",
        "Accuracy (target: every row within +-15%):",
        _stat_line("profile", summ["profile"]),
        _stat_line("fp32 rate", summ["profile_fp32"]),
    ]
    if "fitted_holdout" in summ:
        lines.append(_stat_line("fitted, holdout rows", summ["fitted_holdout"]))
        lines.append(_stat_line("fitted, fit rows", summ["fitted_fit"]))
    lines += [
        "",
        f"The target {'holds' if ok_p else 'does not hold'} for the host profile as measured. "
        + misses_text(result),
        "",
        "The llama.cpp arguments moesim prints (`moesim.engine_args.invocation`, as the deployment answer calls it; "
        "`program=\"llama-bench\"` spells them for llama-bench: `-ts a/b`, `-ot` overrides joined by `;`, "
        "`--cpu-moe` as `--n-cpu-moe <layers>`, no `-c`) run on the 2-layer Q4_K_M file:",
        "",
        "| deployment | form | llama-bench arguments | result |",
        "|---|---|---|---|",
    ]
    for e in result.get("engine_args_checks", []):
        res = (f"ran ({e['tests']} test{'s' if e['tests'] != 1 else ''}, {', '.join(f'{x:g}' for x in e['tps'])} tok/s)"
               if e["ok"] else f"refused (exit {e.get('returncode')}: {'; '.join(e.get('message') or [])[:120]})")
        cell = " ".join(e["args"]).replace("|", "\\|")  # a pipe inside a table cell, even in code, splits it
        lines.append(f"| {e['deployment']} | {e['form']} | `{cell}` | {res} |")
    lines += [
        "",
        "On this CPU-only build the GPU placements (-ngl, --n-cpu-moe, -ot ...=CPU, -ts, -sm) are accepted and run "
        "everything on the CPU (there is no GPU device to place anything on), so these checks show that llama-bench "
        "accepts the printed arguments, not that they place tensors as intended on a GPU build.",
        "",
        f"Reproduce (everything cached under {DEFAULT_WORK.as_posix().replace(str(Path.home()), '~')}; from a fresh "
        "clone the first run downloads, builds and converts, ~35 min on 2 cores, ~21 GB of disk): "
        "`python bench/bench_llamacpp.py --skip-build --remeasure` (about 10-15 minutes on an idle machine: 24 rows, two "
        "host profiles, 33 argument checks; `--quick` for -n 16 -r 3, `--offline` to recompute the predictions from "
        "the cached rows); `--readme-only` regenerates this text from bench/llamacpp.json.",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def misses_text(result: dict) -> str:
    """What misses and why, in words, from the rows' own figures (the breakdowns are the cost model's)."""
    rows = result["rows"]
    hb = (result.get("host_profiles") or {}).get(result.get("host_profile_used", "before")) or {}
    out = []
    if hb and hb["figures"]["bf16_tflops"] < 0.99 * hb["fp32_gemm_tflops"]:  # a profile from before measure_host's fix
        bf, fp = hb["figures"]["bf16_tflops"] * 1e3, hb["fp32_gemm_tflops"] * 1e3
        math_share = statistics.median(r["breakdown_ms"]["experts_math_ms"] / (1e3 / r["predicted_tok_s"])
                                       for r in rows)
        out.append(
            f"With the host profile as measured, moesim is {1 / result['summary']['profile']['all']['median_ratio']:.0f}x "
            f"too slow (median): `measure_host` takes torch's bf16 GEMM as the host's compute rate, {bf:.2g} GFLOP/s "
            f"here against {fp:.3g} GFLOP/s for the same GEMM in fp32 - on a CPU without AVX512-BF16 or AMX (this one "
            "has AVX2 and FMA, no AVX512) torch's bf16 GEMM is a slow fallback - so the routed experts' math is "
            f"{math_share:.0%} of the predicted step (median), while llama.cpp never multiplies in bf16 here (bf16 "
            "weights are converted and multiplied in fp32, Q8_0/Q4_K with 8-bit integer dot products). A host-profile "
            "bug, not an engine figure: moesim's own executor does compute in torch, so the figure is right for it "
            "and wrong for llama.cpp.")
    disp = statistics.median(r["breakdown_ms_fp32"]["experts_dispatch_ms"] / (1e3 / r["predicted_tok_s_fp32"])
                             for r in rows)
    out.append(
        f"With the fp32 GEMM rate the prediction is memory-bound; its remaining misses: (a) the host profile's "
        f"per-expert dispatch ({hb.get('figures', {}).get('expert_dispatch_us', float('nan')):g} us, moesim's own "
        f"Python host pool, which llama.cpp's in-graph mul_mat_id does not pay) is {disp:.0%} of the predicted step "
        "(median);")
    pairs = {}
    for r in rows:
        pairs.setdefault((r["file"], r["depth"]), {})[r["threads"]] = r
    sp = [(p[2]["measured_tok_s"] / p[1]["measured_tok_s"], p[2]["predicted_tok_s_fp32"] / p[1]["predicted_tok_s_fp32"])
          for p in pairs.values() if 1 in p and 2 in p and not p[1]["contended"] and not p[2]["contended"]]
    fit_sp = [p[2]["predicted_tok_s_fitted"] / p[1]["predicted_tok_s_fitted"] for p in pairs.values()
              if 1 in p and 2 in p and "predicted_tok_s_fitted" in p[1] and not p[1]["contended"]
              and not p[2]["contended"]]
    if sp:
        out.append(
            f"(b) threads: over {len(sp)} uncontended (file, depth) pairs llama.cpp decodes "
            f"{statistics.median(m for m, _ in sp):.2f}x faster on 2 threads than on 1 (median), moesim predicts "
            f"{statistics.median(p for _, p in sp):.2f}x: the measured one-core GEMV reads nearly the two-core "
            "bandwidth, so moesim's 1-thread step is as memory-bound as its 2-thread one, where llama.cpp's 1-thread "
            "decode is partly bound by its kernels' math on this AVX2 CPU: the shipped engine profile gives no "
            "per-thread kernel rate (`cpu_kernel_gmacs`)"
            + (f"; with the fitted ones moesim predicts {statistics.median(f for f in fit_sp):.2f}x "
               f"({len(fit_sp)} pairs, fit and holdout)" if fit_sp else "") + ";")
    else:
        out.append("(b) threads: no uncontended pair of 1- and 2-thread rows to compare;")
    n_cont = sum(r["contended"] for r in rows)
    cr = [abs(math.log(r["ratio_fp32"])) for r in rows if r["contended"]]
    ur = [abs(math.log(r["ratio_fp32"])) for r in rows if not r["contended"]]
    out.append(
        f"(c) contention: {n_cont} of {len(rows)} rows were measured while other jobs used the cores"
        + (f" (median |ln(pred/measured)| {statistics.median(cr):.2f} there, {statistics.median(ur):.2f} on the "
           "uncontended rows)" if cr and ur else "")
        + "; llama.cpp's threads synchronise at every op, so one busy neighbour slows a 2-thread decode many-fold.")
    return " ".join(out)



if __name__ == "__main__":
    main()
