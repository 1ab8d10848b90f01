"""Record real routing from any Hugging Face MoE checkpoint the installed transformers runs.

The checkpoint runs with transformers' own reference classes (Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE, DeepSeek-V2/V3, GLM-4 MoE, gpt-oss, ...). In transformers 5.x every MoE
block calls a router module that returns ``(logits, weights, ids)`` -- computed exactly as
the family does (softmax or sigmoid scores, ``norm_topk_prob``, DeepSeek-V3/GLM
group-limited top-k with the score-correction bias, gpt-oss top-k of logits then
softmax). :func:`record` hooks that module, so the recorded ids *are* the model's,
not a re-implementation. Per decode step and MoE layer it keeps:

- the true top-k ids and gate weights (largest first; DeepSeek-style
  ``routed_scaling_factor`` divided out so gates lie in [0, 1]; the factor goes in the header);
- the router's input (the post-attention-normed state) and the residual stream after
  attention, from which three predictions of layer ``j``'s experts are computed after the
  run, each from MoE layer ``j-1``'s state and layer ``j``'s own router module:

  * ``quasi`` (stored in the trace's ``pred_ids``/``pred_gates``): the router on
    ``LN_j(r_{j-1} + d_{j-1})``, ``d`` the gate-weighted *default vectors* -- per layer
    and expert the mean expert output over this run's tokens routed to it (calibrated from
    the same run, by calling the block's expert module with one expert at a time);
  * ``stale``: the router on layer ``j-1``'s own router input (Pre-gated MoE, Hwang et
    al. 2024, arXiv:2308.12066; the "stale gate" of Eliseev & Mazur 2023, arXiv:2312.17238);
  * ``oracle``: the true ids (recall 1, the ceiling);

  recall@k per layer of all three goes in ``header['metrics']['predictors']``.

Dense layers and shared experts are what the model spec says
(:func:`moesim.models.from_hf_config`): routing arrays cover MoE layers only. Prefill is
not recorded; decode steps are. Ctrl-C keeps the finished steps (the first one stops the
loop between two steps, :mod:`moesim.executor.interrupt`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moesim import __version__, budget
from moesim.artefacts import safetensors_header
from moesim.errors import MoesimError
from moesim.executor.defaults import DRAFT_MODEL, SHIPPED_MODEL
from moesim.executor.families import FAMILIES
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.loading import resolve_snapshot, shipped_model
from moesim.executor.profile import DEFAULT_PROMPT
from moesim.hf_config import EXPERT_KEYS, split_config
from moesim.inputs import JSON_CAP, check_input, check_name, kind_of, read_bytes
from moesim.models import ModelSpec, from_hf_config, read_config
from moesim.outputs import check_output_file
from moesim.traces.format import Trace, write_trace
from moesim.traces.header import make_header
from moesim.traces.metrics import recall_per_layer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PREDICTORS = ("quasi", "stale", "oracle")
MAIN_PREDICTOR = "quasi"


# --------------------------------------------------------------------------------------
# Checkpoint identity and size
# --------------------------------------------------------------------------------------


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def checkpoint_folder(model_dir: str | Path) -> Path:
    """A checkpoint folder to record from: a shipped checkpoint's name, a folder, or a
    Hugging Face cache folder (``models--ORG--NAME``: its one snapshot). One line, before
    anything loads, for a folder with no config.json or with a config.json and no weights."""
    shipped = str(model_dir) in (SHIPPED_MODEL, DRAFT_MODEL)
    path = shipped_model(str(model_dir)) if shipped else check_name(Path(model_dir), "model folder")
    kind = kind_of(path)
    if kind == "missing":
        raise MoesimError(f"model folder {path} does not exist")
    if kind != "folder":
        raise MoesimError(f"{path}: not a Hugging Face checkpoint (a {kind}; record reads a folder: config.json "
                          "and its weights)")
    path = resolve_snapshot(path)
    if kind_of(path / "config.json") == "missing":
        raise MoesimError(f"{path}: not a Hugging Face checkpoint (no config.json)")
    cfg = read_config(path / "config.json")  # an unreadable config says so first
    if not weight_files(path):
        index = sorted(p.name for p in path.glob("*.index.json"))
        raise MoesimError(f"{path}: a config.json but no weight files ({', '.join(WEIGHT_SUFFIXES)})"
                          + (f"; {index[0]} names shards that are not there" if index else "")
                          + ": download the weights first")
    check_model_type(path, cfg)
    check_weights(path, cfg)
    return path


def check_model_type(path: Path, cfg: dict) -> None:
    """One line, before loading, for a ``model_type`` the installed transformers has no class
    for (its AutoConfig raises a KeyError deep in loading; a checkpoint with its own code,
    ``auto_map``, is left to transformers)."""
    import transformers  # optional (the record extra), and slow to import: only when recording
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # transformers' own family table

    mtype = cfg.get("model_type")
    if "auto_map" in cfg:
        return
    if not isinstance(mtype, str) or mtype not in CONFIG_MAPPING:

        raise MoesimError(f"{path}: config.json's model_type {mtype!r} is not a model the installed transformers "
                          f"{transformers.__version__} knows: nothing to run it with (a newer transformers, or a "
                          "checkpoint of a known family)")


#: The weight files transformers' from_pretrained loads (a single file, or an index naming shards).
LOADED = ("model.safetensors", "pytorch_model.bin")
_LAYER_OF = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_OF = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[a-z_]+\.)?experts\.(\d+)\.")


def loaded_weights(path: Path) -> list[Path]:
    """The files from_pretrained will load, each a regular file: one line, before loading,
    for weights it would not find (``estimator.safetensors`` alone; an index whose shards
    are missing)."""
    for base in LOADED:  # from_pretrained's order: the single file, then its index
        index = path / f"{base}.index.json"
        if kind_of(path / base) != "missing":
            files = [path / base]
            break
        if kind_of(index) != "missing":
            try:
                shards = json.loads(read_bytes(index, "weight index", JSON_CAP).decode("utf-8"))["weight_map"]
                names = sorted({str(n) for n in shards.values()})
            except (ValueError, KeyError, TypeError, AttributeError):
                raise MoesimError(f"{index}: not a weight index (JSON with a weight_map of tensor -> file)") from None
            if not names or any("/" in n or n in ("", ".", "..") for n in names):
                raise MoesimError(f"{index}: its weight_map names {names[:1] or 'no file'}: not shard files of "
                                  "this folder")
            missing = [n for n in names if kind_of(path / n) == "missing"]
            if missing:
                raise MoesimError(f"{path}: {index.name} names {len(names)} shard(s); {len(missing)} not there "
                                  f"({missing[0]}): download the weights first")
            files = [path / n for n in names]
            break
    else:
        have = ", ".join(p.name for p in weight_files(path)[:3])
        raise MoesimError(f"{path}: weight files ({have}) but none that transformers loads ({' or '.join(LOADED)}, "
                          "or its .index.json with the shards): download the model's weights")
    for f in files:
        if check_input(f, "weight file") != "file":
            raise MoesimError(f"weight file {f} is a pipe: weights are mapped from a file; give a file")
    return files


def check_weights(path: Path, raw: dict) -> None:
    """The weights transformers will load are there and, where their safetensors headers say
    (no tensor is read), agree with config.json: the embedding is [vocab, hidden], and every
    layer and routed expert the config names has weights (transformers would refuse a wrong
    shape only after loading began, and fill a missing layer with random numbers)."""
    files = loaded_weights(path)
    if any(f.suffix != ".safetensors" for f in files):
        return
    shapes = {}
    for f in files:
        shapes.update({name: (t.get("dtype"), t.get("shape")) for name, t in safetensors_header(f).items()
                       if isinstance(t, dict)})
    cfg, _ = split_config(raw)
    vocab, hidden, layers = cfg.get("vocab_size"), cfg.get("hidden_size"), cfg.get("num_hidden_layers")
    experts = next((cfg[k] for k in EXPERT_KEYS if cfg.get(k) is not None), None)
    embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
    if embed and shapes[embed][0] in ("F32", "F16", "BF16") and all(isinstance(v, int) for v in (vocab, hidden)) \
            and shapes[embed][1] != [vocab, hidden]:
        raise MoesimError(f"{path}: {embed} is {shapes[embed][1]} in the weights; config.json says [vocab_size, "
                          f"hidden_size] = [{vocab}, {hidden}]: the weights are of another model (or the config "
                          "was edited)")
    found = {int(m[1]) for n in shapes if (m := _LAYER_OF.search(n))}
    if found and isinstance(layers, int) and not isinstance(layers, bool) and max(found) + 1 < layers:
        raise MoesimError(f"{path}: the weights hold {max(found) + 1} layer(s); config.json says num_hidden_layers = "
                          f"{layers}")
    per: dict[int, set[int]] = {}
    for n in shapes:
        if m := _EXPERT_OF.search(n):
            per.setdefault(int(m[1]), set()).add(int(m[2]))
    if isinstance(experts, int) and not isinstance(experts, bool):
        odd = next(((layer, len(e), max(e)) for layer, e in sorted(per.items()) if len(e) != experts
                    or max(e) >= experts), None)
        if odd:
            raise MoesimError(f"{path}: layer {odd[0]} holds weights for {odd[1]} routed expert(s) (numbered up to "
                              f"{odd[2]}); config.json says {experts}")


def check_record_device(device: str) -> None:
    """``cpu``, or ``cuda`` where there is one and ``accelerate`` is installed (it places a
    large checkpoint over GPUs and host memory: ``device_map='auto'``)."""
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise MoesimError(f"record: device {device!r} is not available (cpu, or cuda when present)")
    if device != "cpu" and importlib.util.find_spec("accelerate") is None:
        raise MoesimError('record --device cuda needs accelerate (device_map="auto"), which is not installed: '
                          'pip install "moesim[record]"')


def record_spec(model_dir: Path) -> ModelSpec:
    """The checkpoint's spec (:func:`moesim.models.from_hf_config`), with the executor's
    family adapter's corrections where it has one (GLM-4.7-Flash's ``mlp_layer_types``)."""
    spec = from_hf_config(model_dir / "config.json")
    cfg = read_config(model_dir / "config.json")
    fam = FAMILIES.get(cfg.get("model_type"))
    return fam.fix_spec(cfg, spec, model_dir / "config.json") if fam is not None else spec


def revision_hash(model_dir: str | Path) -> str:
    """sha256 over config.json and the weight files (names and bytes, in name order)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for p in [model_dir / "config.json", *weight_files(model_dir)]:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_record_budget(spec, tokens: int, rows: int, prompt_len: int) -> None:
    """Refuse, before a model loads, a recording that cannot fit in this machine's memory or
    would run for more than a day (the estimate of ``moesim profile``'s resident decode,
    ``rows`` sequences a step; moesim.budget)."""
    budget.check(budget.decode_estimate(spec, tokens, rows, 4, 1.0, 0, False, prompt_len))


def check_fits(model_dir: Path, device: str, upcast: float = 1.0) -> int:
    """Raise one line if the weights (times ``upcast``) cannot fit where they would load."""
    need = int(sum(p.stat().st_size for p in weight_files(model_dir)) * upcast)
    host = _host_available()
    if device == "cpu":
        have, where = int(host * 0.9), "host memory"
    else:
        gpus = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        have, where = int(0.9 * (gpus + host)), "GPU memory plus host memory (device_map='auto')"
    if need > have:
        raise MoesimError(f"{model_dir.name} needs ~{need / 2**30:.1f} GiB to load; {where} has "
                          f"{have / 2**30:.1f} GiB free")
    return need


# --------------------------------------------------------------------------------------
# Finding the routers
# --------------------------------------------------------------------------------------


@dataclass
class MoeLayer:
    """One MoE block of the loaded model and what the hooks capture there, per decode step."""

    layer: int  # model layer index
    block: torch.nn.Module
    router: torch.nn.Module
    norm: torch.nn.Module  # the layer's post-attention norm (the router input's norm)
    ids: list[np.ndarray] = field(default_factory=list)  # per step [B, k]
    gates: list[np.ndarray] = field(default_factory=list)
    x: list[torch.Tensor] = field(default_factory=list)  # router input [B, H]
    resid: list[torch.Tensor] = field(default_factory=list)  # residual after attention [B, H]
    call: RouterCall | None = None  # how the block calls its router (what predictions call it with)


@dataclass
class RouterCall:
    """How a block calls its router beyond the hidden states: the rank of the input it
    passes (``[N, H]`` or ``[B, T, H]``) and any further arguments (MiniMax-M2's and
    Afmoe's routers take the selection bias; LFM2-MoE's optionally), kept from the first
    call so predictions call the router exactly as the block does."""

    ndim: int = 2
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _router_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor, RouterCall]:
    """The hidden states a router was called with, wherever they were passed, and the rest."""
    if args:
        x, rest, kw = args[0], args[1:], dict(kwargs)
    else:
        kw = dict(kwargs)
        key = "hidden_states" if "hidden_states" in kw else next(
            (k for k, v in kw.items() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
        if key is None:
            raise MoesimError("a router was called without hidden states it could record")
        x, rest = kw.pop(key), ()
    return x, RouterCall(x.dim(), rest, kw)


def _decoder_layers(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise MoesimError(f"{type(model).__name__}: no decoder layers found (model.model.layers)")
    return layers


def find_moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """Per decoder layer with a router module (a child returning (logits, weights, ids))."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        # The MoE block's attribute: mlp (most), block_sparse_moe (Mixtral-style), feed_forward
        # (Llama-4, Jamba).
        block = next((b for n in ("mlp", "block_sparse_moe", "feed_forward") if (b := getattr(layer, n, None))), None)
        if block is None:
            continue
        router = next((getattr(block, n) for n in ("gate", "router") if hasattr(block, n)), None)
        kind = type(router).__name__.lower()
        if router is None or not hasattr(block, "experts") or not kind.endswith(("router", "gate")) \
                or type(router) is torch.nn.Linear:
            continue  # a dense MLP (its ``gate_proj`` is not a router), or a bare linear gate
        # The norm before the MoE block (Jamba names it pre_ff_layernorm).
        norm = getattr(layer, "post_attention_layernorm", None) or getattr(layer, "pre_ff_layernorm", None)
        if norm is None:
            raise MoesimError(f"{type(layer).__name__}: no post_attention_layernorm; cannot record predictors")
        out.append(MoeLayer(i, block, router, norm))
    return out


def _placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where ``module`` computes and in what dtype. With ``device_map='auto'`` and host
    offload, accelerate leaves weights on ``meta`` and names the device in its hook."""
    p = next(module.parameters())
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None) if p.device.type == "meta" else None
    return (torch.device(dev) if dev is not None else p.device), p.dtype


def _route(router: torch.nn.Module, x: torch.Tensor, scale: float,
           call: RouterCall | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, gates) [N, k] from the router module called as its block calls it (``call``),
    largest gate first, gates / ``scale``."""
    call = call or RouterCall()
    _, w, ids = _router_output(router(x.view(1, *x.shape) if call.ndim == 3 else x, *call.args, **call.kwargs), router)
    w = w.float().reshape(-1, w.shape[-1]) / scale
    ids = ids.reshape(-1, ids.shape[-1])
    order = w.argsort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), w.gather(-1, order)


def _router_output(out, router: torch.nn.Module | None = None) -> tuple:
    """A router's ``(logits, weights, ids)``, checked: transformers 5.x MoE routers return
    that triple; Llama-4's returns ``(scores, logits)`` with every expert's score (0 where
    it is not routed), so its top-``router.top_k`` are read off the scores."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and getattr(router, "top_k", None):
        scores, logits = out
        w, ids = scores.reshape(-1, scores.shape[-1]).topk(int(router.top_k), dim=-1)
        return logits, w, ids
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        raise MoesimError(f"a router returned {type(out).__name__}, not (logits, weights, ids): not recordable")
    return out[0], out[1], out[2]


# --------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------


def prompt_ids(prompts: Any, model_dir: Path, vocab: int, batch: int | None) -> tuple[torch.Tensor, str]:
    """[B, P] token ids from ids or texts; texts use the checkpoint's tokenizer (bytes for a
    256-token vocabulary). Rows of unequal length keep their last ``min length`` tokens.
    No prompts: a fixed Python snippet for a byte-level model, else 16 seeded random ids."""
    if prompts is None or (isinstance(prompts, (list, tuple)) and not prompts):
        if vocab == 256:
            prompts = [DEFAULT_PROMPT]
        else:
            gen = torch.Generator().manual_seed(0)
            prompts = torch.randint(0, vocab, (1, 16), generator=gen)
    if isinstance(prompts, (np.ndarray, torch.Tensor)) or (prompts and not isinstance(prompts[0], str)):
        rows = [list(map(int, r)) for r in (prompts.tolist() if hasattr(prompts, "tolist") else prompts)]
        how = "token ids"
    else:
        texts = list(prompts)
        if any((model_dir / f).is_file() for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer  # optional and heavy (the record extra)

            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            rows = [tok(t)["input_ids"] for t in texts]
            how = "texts, checkpoint tokenizer"
        elif vocab == 256:  # byte-level model (the shipped moe-stdlib)
            rows = [list(t.encode()) for t in texts]
            how = "texts, UTF-8 bytes"
        else:
            raise MoesimError(f"{model_dir.name} has no tokenizer files; pass token ids as prompts")
    if not rows or any(len(r) == 0 for r in rows):
        raise MoesimError("record: every prompt needs at least one token")
    if batch:
        rows = [rows[i % len(rows)] for i in range(batch)]
    n = min(len(r) for r in rows)
    ids = torch.tensor([r[len(r) - n:] for r in rows], dtype=torch.long)
    if ids.min() < 0 or ids.max() >= vocab:
        raise MoesimError(f"record: prompt token ids outside the vocabulary [0, {vocab})")
    return ids, how


# --------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    probs = (logits.float() / temperature).softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=gen).to(logits.device)


def _forward(model, ids: torch.Tensor, cache):
    kw = {"use_cache": True}
    if cache is not None:
        kw["cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"] = cache
    out = model(input_ids=ids, **kw)
    return out.logits[:, -1], getattr(out, "past_key_values", None) or getattr(out, "cache", None)


def load_model(model_dir: Path, device: str):
    """The checkpoint in transformers' reference classes: fp32 on CPU, its own dtype with
    ``device_map='auto'`` on CUDA (large checkpoints spread over GPUs, then host)."""
    from transformers import AutoModelForCausalLM  # optional and heavy (the record extra)

    if device == "cpu":
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto", device_map="auto",
                                                     local_files_only=True)
    return model.eval()


@torch.no_grad()
def record(model_dir: str | Path, prompts: Any, tokens: int = 64, device: str = "cpu", batch: int | None = None,
           temperature: float = 0.0, seed: int = 0, progress: Callable[[int, int], None] | None = None,
           prompt_source: str = "") -> Trace:
    """Decode ``tokens`` steps from ``prompts`` with the checkpoint in ``model_dir`` (or a
    shipped checkpoint's name, e.g. ``moe-stdlib``) and return its routing as a trace (no
    timings). ``temperature`` 0 = greedy."""
    model_dir = checkpoint_folder(model_dir)
    if tokens < 1:
        raise MoesimError("record: tokens must be >= 1")
    if batch is not None and (isinstance(batch, bool) or batch < 1):  # 0 meant "one per prompt", silently
        raise MoesimError(f"record: --batch {batch}: a whole number >= 1 (leave it out for one sequence a prompt)")
    if not 0 <= temperature < math.inf:  # -1 decoded greedily, inf sampled uniformly, both silently
        raise MoesimError(f"record: --temperature {temperature}: 0 (greedy) or a positive finite number")
    check_record_device(device)
    spec = record_spec(model_dir)
    if not spec.top_k:
        raise MoesimError(f"{model_dir}: config has no experts-per-token")
    prompt, how = prompt_ids(prompts, model_dir, spec.vocab, batch)
    cfg = read_config(model_dir / "config.json")
    cfg_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    check_fits(model_dir, device, upcast=2.0 if device == "cpu" and "16" in cfg_dtype else 1.0)
    check_record_budget(spec, tokens, prompt.shape[0], prompt.shape[1])
    model = load_model(model_dir, device)
    layers = find_moe_layers(model)
    if tuple(m.layer for m in layers) != spec.moe_layers:
        raise MoesimError(f"{model_dir.name}: routers found at layers {[m.layer for m in layers]}, but the config "
                          f"says MoE layers are {list(spec.moe_layers)}")
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    first_device = model.get_input_embeddings().weight.device  # device_map='auto': inputs go where the embedding is
    b = prompt.shape[0]

    state = {"on": False}
    hooks = []
    for m in layers:
        def on_router(mod, args, kwargs, out, m=m):
            if state["on"]:
                x, call = _router_input(args, kwargs)
                m.call = m.call or call
                x = x.reshape(-1, x.shape[-1])
                _, w, ids = _router_output(out, mod)
                w = w.float().reshape(-1, w.shape[-1]) / scale
                order = w.argsort(dim=-1, descending=True, stable=True)
                m.ids.append(ids.reshape(-1, ids.shape[-1]).gather(-1, order).cpu().numpy())
                m.gates.append(w.gather(-1, order).cpu().numpy())
                m.x.append(x.detach().cpu())  # model dtype (bf16 on GPU): T x M x B x H each for x and resid

        def on_norm(mod, args, m=m):
            if state["on"]:
                m.resid.append(args[0].reshape(-1, args[0].shape[-1]).detach().cpu())

        hooks += [m.router.register_forward_hook(on_router, with_kwargs=True),
                  m.norm.register_forward_pre_hook(on_norm)]

    gen = torch.Generator().manual_seed(seed)
    out_tokens: list[torch.Tensor] = []
    try:
        with stop_on_interrupt():  # the first Ctrl-C stops between steps; a second raises at once
            _decode(model, prompt, tokens, temperature, gen, first_device, state, out_tokens, progress)
    except KeyboardInterrupt:
        pass  # keep what finished
    finally:
        for h in hooks:
            h.remove()
    done = min(len(out_tokens), *(min(len(m.ids), len(m.resid)) for m in layers))
    if done == 0:
        raise Interrupted("interrupted before the first decode step finished: nothing to keep")  # exit 130, as profile
    for m in layers:
        for name in ("ids", "gates", "x", "resid"):
            setattr(m, name, getattr(m, name)[:done])
    if any(m.ids[0].shape != (b, spec.top_k) for m in layers):
        raise MoesimError(f"{model_dir.name}: the router returned shape {layers[0].ids[0].shape}, expected "
                          f"[batch={b}, top_k={spec.top_k}]")

    true_ids = np.stack([np.stack(m.ids) for m in layers], 1).astype(np.int16)  # [T, M, B, k]
    true_gates = np.stack([np.stack(m.gates) for m in layers], 1).astype(np.float32)
    preds = predictions(layers, spec, scale)
    recalls = {name: _recall(true_ids, p[0]) for name, p in preds.items()}
    pred_ids, pred_gates = preds[MAIN_PREDICTOR]
    header = make_header(
        spec, policy="none", params={"predictor": MAIN_PREDICTOR, "temperature": temperature},
        prompt_len=int(prompt.shape[1]), n_tokens=done, batch=b, seed=seed, synthetic=False,
        metrics={"recall_at_k": recalls[MAIN_PREDICTOR], "predictors": recalls},
        recorded={
            "tool": f"moesim {__version__}", "how": "recorded from a real model (transformers reference classes, "
            "router modules hooked); routing only, no timings",
            "model_name": spec.name, "model_source": str(model_dir), "revision_sha256": revision_hash(model_dir),
            "prompts": prompt_source or how, "decoding": "greedy" if temperature <= 0 else f"sampled, T={temperature}",
            "routed_scaling_factor": scale, "device": device, "torch": torch.__version__,
            "transformers": _transformers_version(), "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "interrupted": done < tokens,
        },
    )
    token_ids = torch.cat(out_tokens[:done], 1).numpy().astype(np.int32)
    return Trace(header, prompt.numpy().astype(np.int32), token_ids, true_ids, np.clip(true_gates, 0, 1),
                 pred_ids, pred_gates, true_ids.copy())


def _decode(model, prompt: torch.Tensor, tokens: int, temperature: float, gen: torch.Generator, device,
            state: dict, out_tokens: list[torch.Tensor], progress: Callable[[int, int], None] | None) -> None:
    """Prefill, then ``tokens`` decode steps with the router hooks on (``state['on']``),
    appending each fed token to ``out_tokens``; stops early when a stop is requested."""
    logits, cache = _forward(model, prompt.to(device), None)
    tok = _next_token(logits, temperature, gen)
    for i in range(tokens):
        if stop_requested():
            break
        state["on"] = True
        try:
            logits, cache = _forward(model, tok.to(device), cache)
        finally:
            state["on"] = False
        out_tokens.append(tok.cpu())
        tok = _next_token(logits, temperature, gen)
        if progress:
            progress(i + 1, tokens)


def _transformers_version() -> str:
    import transformers  # optional and heavy (the record extra)

    return transformers.__version__


def _recall(true_ids: np.ndarray, pred_ids: np.ndarray) -> list[float]:
    return [float(x) for x in recall_per_layer(true_ids, pred_ids)]


def default_vectors(layers: list[MoeLayer], spec: ModelSpec) -> list[torch.Tensor]:
    """Per MoE layer [E, H]: each expert's mean output over this run's tokens routed to it
    (zero for an expert never chosen), computed by the block's own expert module."""
    out = []
    for m in layers:
        dev, dtype = _placement(m.block.experts)
        x = torch.cat(m.x).to(dev, dtype)  # [T*B, H]
        ids = torch.from_numpy(np.concatenate(m.ids)).to(dev).long()  # [T*B, k]
        sums = torch.zeros(spec.n_experts, x.shape[-1])
        counts = torch.zeros(spec.n_experts)
        one = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        for s in range(ids.shape[1]):
            y = _expert_outputs(m.block.experts, x, ids[:, s:s + 1], one).float().cpu()
            sums.index_add_(0, ids[:, s].cpu(), y)
            counts.index_add_(0, ids[:, s].cpu(), torch.ones(ids.shape[0]))
        out.append(sums / counts.clamp(min=1)[:, None])
    return out


def _expert_outputs(experts: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Each token's output of its expert ``ids[:, 0]`` [N, H], by the block's own expert
    module: transformers 5.x experts take ``(x, ids, gates)``; Llama-4's take every
    expert's copy of the tokens at once (``[E * N, H]`` in, the same out), so each token's
    row is read from its expert's block."""
    if len(inspect.signature(experts.forward).parameters) >= 3:
        return experts(x, ids, gates)
    n_exp = experts.num_experts
    y = experts(x.repeat(n_exp, 1)).view(n_exp, x.shape[0], -1)  # [E, N, H]
    return y[ids[:, 0], torch.arange(x.shape[0], device=x.device)] * gates


def predictions(layers: list[MoeLayer], spec: ModelSpec, scale: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """quasi / stale / oracle predictions [T, M, B, k] of each MoE layer from the previous one."""
    t, b, k = len(layers[0].ids), layers[0].ids[0].shape[0], spec.top_k
    m_count = len(layers)
    dv = default_vectors(layers, spec)
    out = {}
    for name in ("quasi", "stale"):
        ids = np.full((t, m_count, b, k), -1, np.int16)
        gates = np.zeros((t, m_count, b, k), np.float32)
        for j in range(1, m_count):
            prev, cur = layers[j - 1], layers[j]
            r_dev, r_dtype = _placement(cur.router)
            if name == "stale":
                q = torch.cat(prev.x)
            else:
                g = torch.from_numpy(np.concatenate(prev.gates))  # [T*B, k]
                e = torch.from_numpy(np.concatenate(prev.ids)).long()
                d = (dv[j - 1][e] * g[..., None]).sum(1)
                q = cur.norm((torch.cat(prev.resid).float() + d).to(*_placement(cur.norm)))
            pi, pg = _route(cur.router, q.to(r_dev, r_dtype if r_dtype.is_floating_point else q.dtype), scale, cur.call)
            ids[:, j] = pi.cpu().numpy().reshape(t, b, k)
            gates[:, j] = np.clip(pg.cpu().numpy().reshape(t, b, k), 0, 1)
        out[name] = (ids, gates)
    true_ids = np.stack([np.stack(m.ids) for m in layers], 1).astype(np.int16)
    true_gates = np.stack([np.stack(m.gates) for m in layers], 1).astype(np.float32)
    oracle_ids, oracle_gates = true_ids.copy(), np.clip(true_gates, 0, 1)
    oracle_ids[:, 0], oracle_gates[:, 0] = -1, 0  # like every predictor: nothing before the first MoE layer
    out["oracle"] = (oracle_ids, oracle_gates)
    return out


def record_trace(model_dir: str | Path, out: str | Path, prompts: Any, **kw: Any) -> Trace:
    """``moesim record``: :func:`record`, then write the trace atomically to ``out``."""
    check_output_file(out, (".npz",))  # before the model loads, not after the run
    trace = record(model_dir, prompts, **kw)
    write_trace(trace, out)
    return trace
