"""Record real speculative trees and the target's real routing from a Hugging Face target/draft pair.

``moesim record TARGET --draft DRAFT``: both checkpoints run in transformers' own
reference classes, as in :mod:`moesim.executor.record` (whose router hooks, prompt and
checkpoint helpers this module reuses). Each verification step, batch 1, greedy:

1. the draft (any causal LM with the target's vocabulary) reads the text committed so far
   (its KV cache grows by the newly committed tokens) and grows a candidate tree level by
   level: the top-``branch`` children of every node by draft probability, to ``depth``;
   each level is one draft forward over the whole tree with a tree attention mask,
   after which the draft's cache is cut back to the committed text;
2. a selection picks ``budget`` nodes (``confidence`` or ``ecospec``,
   :func:`moesim.selection.select`, the same decision the executor and the what-if make);
   EcoSpec needs per-node expert predictions, which come from the draft's expert predictor
   (``expert_predictor.safetensors`` in the draft folder, as ``moesim
   train-expert-predictor`` writes it) applied to the draft's final normed hidden state;
3. the TARGET verifies the root (the last committed token) and the chosen nodes in ONE
   forward pass with tree attention: a 4D additive attention mask (committed prefix plus
   each row's ancestors) and explicit position ids (prefix length + depth), which
   transformers' mask builder passes through unchanged. Its hooked router modules record
   the routed experts and gates of EVERY verified row at every MoE layer;
4. greedy acceptance (:func:`moesim.selection.accept`) walks the tree along the target's
   own argmax; the target's KV cache keeps the committed entries plus the accepted rows
   (an index select on each cache layer), and the target's token after the last accepted
   row (the bonus token) becomes the next step's root.

Speculation never changes the tokens: the accepted tokens are the target's plain greedy
decode, and the routing of an accepted row is the routing plain ``moesim record`` sees for
the same token (tests/test_record_draft.py checks both). The trace is a version-2 trace
(:mod:`moesim.traces.records`): the accepted rows as the main routing arrays, one
``sd_*`` record per verification step. It holds routing, not timings: the ``sd_*_s``
arrays are zero (the reference classes are not the offload engine; nothing is measured).

Tree attention needs a plain growing KV cache (``DynamicLayer``); a family whose cache
layers slide or compress (gpt-oss's sliding windows, ...) is refused with one line.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moesim import __version__
from moesim.errors import MoesimError
from moesim.executor.defaults import RECORD_DRAFT
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.model import TreeMask
from moesim.executor.record import (
    _router_output,
    _transformers_version,
    check_fits,
    check_record_budget,
    checkpoint_folder,
    find_moe_layers,
    load_model,
    prompt_ids,
    revision_hash,
)
from moesim.executor.speculative import check_tree_size, load_expert_predictor
from moesim.models import ModelSpec, from_hf_config, read_config
from moesim.outputs import check_output_file
from moesim.selection import SCORES, SELECTIONS, Tree, accept, check_lambda, select
from moesim.traces.format import Trace, write_trace
from moesim.traces.header import make_header
from moesim.traces.records import SDStep, expert_mask, sd_arrays

PREDICTOR_FILE = "expert_predictor.safetensors"  # the executor's name (executor/speculative.py)


@dataclass(frozen=True)
class DraftSettings:
    """The tree and the selection (the names of ``moesim speculate``'s options)."""

    depth: int = RECORD_DRAFT["depth"]  # levels of the candidate tree
    branch: int = RECORD_DRAFT["branch"]  # children per node (top-branch by draft probability)
    budget: int = RECORD_DRAFT["budget"]  # candidates verified per step besides the root (gamma)
    selection: str = RECORD_DRAFT["selection"]
    score: str = RECORD_DRAFT["score"]
    lam: float = RECORD_DRAFT["lam"]

    def __post_init__(self) -> None:
        if self.depth < 1 or self.branch < 1 or self.budget < 0:
            raise MoesimError("record --draft: --tree-depth >= 1, --tree-branch >= 1, --budget >= 0")
        check_tree_size(self.depth, self.branch, "record --draft")
        if self.selection not in SELECTIONS:
            raise MoesimError(f"unknown selection {self.selection!r}; known: {', '.join(SELECTIONS)}")
        if self.score not in SCORES:
            raise MoesimError(f"unknown score {self.score!r}; known: {', '.join(SCORES)}")
        check_lambda(self.lam)


@dataclass
class VerifiedStep:
    """One finished verification step (appended in one statement, so Ctrl-C never halves one)."""

    tree: Tree
    chosen: list[int]
    accepted_rows: list[int]  # rows accepted, 0 (the root) first
    row_tokens: list[int]  # the root, then the chosen candidates
    row_ids: np.ndarray  # int [rows, M, k] the target's routed experts, largest gate first
    row_gates: np.ndarray  # float [rows, M, k]
    root_experts: list[set[int]]  # predicted experts of the root, per MoE layer (empty: no predictor)
    draft_s: float
    verify_s: float


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


def _resolve(name: str | Path) -> Path:
    return checkpoint_folder(name)


def _vocab(cfg: dict) -> int | None:
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


def _upcast(cfg: dict, device: str) -> float:
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return 2.0 if device == "cpu" and "16" in dtype else 1.0


def load_predictor(draft_dir: Path, draft_hidden: int, spec: ModelSpec):
    """The draft's expert predictor if its folder has one that fits this pair (draft hidden
    size, target layers and experts), else None (the reason as the second value)."""
    if not (draft_dir / PREDICTOR_FILE).is_file():
        return None, f"{draft_dir.name} has no {PREDICTOR_FILE} (moesim train-expert-predictor)"
    pred = load_expert_predictor(draft_dir)
    have = (pred.probes.in_features, pred.layers, pred.experts)
    want = (draft_hidden, spec.n_layers, spec.n_experts)
    if have != want:
        return None, (f"{draft_dir.name}/{PREDICTOR_FILE} maps hidden {have[0]} to {have[1]} layers x {have[2]} "
                      f"experts; this pair needs {want[0]} to {want[1]} x {want[2]}")
    return pred, ""


# --------------------------------------------------------------------------------------
# Tree attention on transformers models
# --------------------------------------------------------------------------------------


def _check_cache(cache, family: str) -> None:
    from transformers.cache_utils import DynamicLayer  # optional and heavy (the record extra)

    layers = getattr(cache, "layers", None)
    if layers is None or any(type(lay) is not DynamicLayer for lay in layers):
        kinds = sorted({type(lay).__name__ for lay in layers or []}) or [type(cache).__name__]
        raise MoesimError(f"record --draft: {family}'s KV cache ({', '.join(kinds)}) is not a plain growing cache; "
                          "tree verification needs one")


def _keep(cache, index: torch.Tensor) -> None:
    """Keep only the cache entries at ``index`` (sequence positions), in that order."""
    for lay in cache.layers:
        if lay.is_initialized and lay.keys.numel():
            idx = index.to(lay.keys.device)
            lay.keys = lay.keys.index_select(-2, idx)
            lay.values = lay.values.index_select(-2, idx)


def _cut(cache, length: int) -> None:
    _keep(cache, torch.arange(length))


def _tree_forward(model, tokens: list[int], parents: list[int], cache, past: int, device) -> Any:
    """One forward over ``tokens`` placed after ``past`` cached tokens, each attending to the
    prefix, its ancestors (``parents``: index among ``tokens``, -1 none) and itself.
    Returns the model output (logits [1, t, V]); the cache grows by t entries."""
    tm = TreeMask.from_parents(parents, past)
    dtype = model.get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    mask = torch.zeros(tm.mask.shape, dtype=dtype).masked_fill(~tm.mask, torch.finfo(dtype).min)
    return model(input_ids=torch.tensor([tokens], device=device), attention_mask=mask[None, None].to(device),
                 position_ids=tm.positions[None].to(device), use_cache=True, **_cache_kw(model, cache))


def _plain_forward(model, tokens: list[int], cache, device) -> Any:
    return model(input_ids=torch.tensor([tokens], device=device), use_cache=True, **_cache_kw(model, cache))


def _cache_kw(model, cache) -> dict:
    """transformers 5.x renames ``past_key_values`` to ``cache`` (the old name warns)."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


# --------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------


class Pair:
    """The loaded target and draft, their KV caches and the hooks that read them: the
    target's router modules (every row's routed experts and gates, per MoE layer) and, with
    an expert predictor, the draft's final norm (the predictor's input)."""

    def __init__(self, target, draft, spec: ModelSpec, scale: float, predictor, names: tuple[str, str]) -> None:
        from transformers.cache_utils import DynamicCache  # optional and heavy (the record extra)

        self.target, self.draft, self.spec, self.predictor, self.names = target, draft, spec, predictor, names
        self.t_dev = target.get_input_embeddings().weight.device  # device_map='auto': inputs go to the embedding
        self.d_dev = draft.get_input_embeddings().weight.device
        self.t_cache, self.d_cache = DynamicCache(config=target.config), DynamicCache(config=draft.config)
        self.t_len = self.d_len = 0  # entries in each cache
        layers = find_moe_layers(target)
        if tuple(m.layer for m in layers) != spec.moe_layers:
            raise MoesimError(f"{names[0]}: routers found at layers {[m.layer for m in layers]}, but the config "
                              f"says MoE layers are {list(spec.moe_layers)}")
        self.routed: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(layers)  # last forward's (ids, gates)
        self.hidden: torch.Tensor | None = None  # the draft's last final normed hidden state [t, d]
        self.hooks = []
        for j, m in enumerate(layers):
            def on_router(mod, args, out, j=j):
                _, w, ids = _router_output(out, mod)
                out = (None, w.reshape(-1, w.shape[-1]), ids.reshape(-1, ids.shape[-1]))
                w = out[1].float() / scale  # routed_scaling_factor divided out, as plain record does
                order = w.argsort(dim=-1, descending=True, stable=True)
                self.routed[j] = (out[2].gather(-1, order).cpu().numpy(), w.gather(-1, order).cpu().numpy())

            self.hooks.append(m.router.register_forward_hook(on_router))
        if predictor is not None:
            norm = getattr(getattr(draft, "model", draft), "norm", None)
            if norm is None:
                raise MoesimError(f"{names[1]}: no final norm (model.norm) to read the predictor's input from")
            self.hooks.append(norm.register_forward_hook(lambda mod, a, o: setattr(self, "hidden", o[0].float())))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def predict(self, h: torch.Tensor) -> list[list[set[int]]]:
        """Per row of ``h`` [n, d], per MoE layer: the predictor's top-k experts."""
        top = self.predictor(h.cpu()).topk(self.spec.top_k, -1).indices[:, list(self.spec.moe_layers)]  # [n, M, k]
        return [[set(r.tolist()) for r in row] for row in top]

    def prefill(self, prompt: list[int]) -> int:
        """The target reads the prompt (routing not recorded, as plain record); its next token."""
        out = _plain_forward(self.target, prompt, self.t_cache, self.t_dev)
        _check_cache(self.t_cache, self.names[0])
        self.t_len = len(prompt)
        return int(out.logits[0, -1].argmax())

    def draft_tree(self, committed: list[int], st: DraftSettings) -> tuple[Tree, list[set[int]]]:
        """The draft reads what was committed since its last call, then grows the candidate
        tree: top-``branch`` children per node to ``depth``, greedy by draft probability; one
        draft forward per level over the tree so far, the cache cut back to the committed
        text after each. Returns the tree and the root's predicted experts."""
        out = _plain_forward(self.draft, committed[self.d_len:], self.d_cache, self.d_dev)
        if self.d_len == 0:
            _check_cache(self.d_cache, self.names[1])
        self.d_len = len(committed)
        root_experts = self.predict(self.hidden[-1:])[0] if self.predictor is not None else []
        tree, frontier, logits = Tree(), [-1], out.logits[0, -1:].float()  # row -1 = the root
        for level in range(st.depth):
            new_frontier = []
            for f in frontier:
                probs = logits[f].softmax(-1)
                pr, ids = probs.topk(min(st.branch, probs.numel()))
                base = 1.0 if f == -1 else tree.prob[f]
                for pi, ti in zip(pr.tolist(), ids.tolist(), strict=True):
                    tree.tokens.append(int(ti))
                    tree.parents.append(f)
                    tree.prob.append(base * pi)
                    new_frontier.append(len(tree) - 1)
            frontier = new_frontier
            if level == st.depth - 1 and self.predictor is None:
                break  # the deepest level's logits are never read
            out = _tree_forward(self.draft, tree.tokens, tree.parents, self.d_cache, self.d_len, self.d_dev)
            _cut(self.d_cache, self.d_len)
            logits = torch.cat([out.logits[0].float(), logits[-1:]])  # row i = node i; the root stays last
            if self.predictor is not None:
                tree.experts += self.predict(self.hidden[len(tree.experts):])
        return tree, root_experts

    def verify(self, rows: list[int], parents: list[int]) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The target reads the root and the chosen nodes in one tree-attention pass after
        its cache. Returns its argmax after every row and every row's routing [rows, M, k]
        (ids, gates); the rows stay in the cache until :meth:`keep`."""
        self.routed[:] = [None] * len(self.routed)
        out = _tree_forward(self.target, rows, parents, self.t_cache, self.t_len, self.t_dev)
        k = self.spec.top_k
        if any(r is None or r[0].shape != (len(rows), k) for r in self.routed):
            raise MoesimError(f"{self.names[0]}: the routers did not return [rows={len(rows)}, top_k={k}] per MoE "
                              "layer during verification")
        return (out.logits[0].argmax(-1).tolist(), np.stack([r[0] for r in self.routed], 1),
                np.stack([r[1] for r in self.routed], 1))

    def keep(self, accepted_rows: list[int]) -> None:
        """The target's cache keeps the committed entries and the accepted rows only."""
        _keep(self.t_cache, torch.cat([torch.arange(self.t_len), self.t_len + torch.tensor(accepted_rows)]))
        self.t_len += len(accepted_rows)


def decode(pair: Pair, prompt: list[int], tokens: int, st: DraftSettings, steps: list[VerifiedStep],
           progress: Callable[[int, int], None] | None = None) -> None:
    """Greedy speculative decoding until ``tokens`` rows are accepted or a stop is
    requested; appends each finished step to ``steps`` in one statement (the caller's list,
    so an interrupt at any instant leaves exactly the finished steps there)."""
    root = pair.prefill(prompt)
    committed = [*prompt, root]
    produced = 0
    while produced < tokens and not stop_requested():
        t0 = time.perf_counter()
        tree, root_experts = pair.draft_tree(committed, st)
        chosen = select(tree, st.budget, st.selection, root_experts or None, st.score, st.lam)
        t1 = time.perf_counter()
        rows = [root] + [tree.tokens[c] for c in chosen]
        parents = [-1] + [0 if tree.parents[c] == -1 else 1 + chosen.index(tree.parents[c]) for c in chosen]
        target_next, row_ids, row_gates = pair.verify(rows, parents)
        acc = accept(tree, chosen, target_next)
        pair.keep(acc)
        steps.append(VerifiedStep(tree, chosen, acc, rows, row_ids, row_gates, root_experts, t1 - t0,
                                  time.perf_counter() - t1))
        produced += len(acc)
        root = target_next[acc[-1]]  # the bonus token: the target's own after the accepted path
        committed += [rows[r] for r in acc[1:]] + [root]
        if progress:
            progress(min(produced, tokens), tokens)


@torch.no_grad()
def record_speculative(target_dir: str | Path, draft_dir: str | Path, prompts: Any, tokens: int = 32,
                       settings: DraftSettings = DraftSettings(), device: str = "cpu", seed: int = 0,
                       progress: Callable[[int, int], None] | None = None, prompt_source: str = "") -> Trace:
    """Greedy speculative decoding of one prompt with ``draft_dir`` proposing and
    ``target_dir`` verifying, until at least ``tokens`` tokens are accepted (whole steps:
    the last step may accept a few more). Returns a version-2 trace with the target's real
    routing of every verified row. Every input is checked before a model loads. Ctrl-C
    keeps the finished steps."""
    target_dir, draft_dir = _resolve(target_dir), _resolve(draft_dir)
    if tokens < 1:
        raise MoesimError("record: tokens must be >= 1")
    if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
        raise MoesimError(f"record: device {device!r} is not available (cpu, or cuda when present)")
    tcfg, dcfg = read_config(target_dir / "config.json"), read_config(draft_dir / "config.json")
    spec = from_hf_config(target_dir / "config.json")
    if not spec.top_k:
        raise MoesimError(f"{target_dir}: config has no experts-per-token")
    dvocab = _vocab(dcfg)
    if dvocab != spec.vocab:
        raise MoesimError(f"record --draft: the draft {draft_dir.name} has a vocabulary of {dvocab} tokens, the target "
                          f"{target_dir.name} {spec.vocab}; a draft must share the target's tokenizer")
    prompt, how = prompt_ids(prompts, target_dir, spec.vocab, None)
    if prompt.shape[0] != 1:
        raise MoesimError("record --draft decodes one sequence: give one prompt")
    check_record_budget(spec, tokens, 1 + settings.budget, prompt.shape[1])
    dhidden = int(dcfg.get("hidden_size") or (dcfg.get("text_config") or {}).get("hidden_size") or 0)
    predictor, why = load_predictor(draft_dir, dhidden, spec)
    if settings.selection == "ecospec" and predictor is None:
        raise MoesimError(f"record --draft --selection ecospec needs the draft's expert predictor: {why}")
    check_fits(target_dir, device, _upcast(tcfg, device))
    check_fits(draft_dir, device, _upcast(dcfg, device))

    scale = float(tcfg.get("routed_scaling_factor") or 1.0)
    pair = Pair(load_model(target_dir, device), load_model(draft_dir, device), spec, scale, predictor,
                (target_dir.name, draft_dir.name))
    steps: list[VerifiedStep] = []
    try:
        # A second Ctrl-C raises at once: ``steps`` still holds exactly the finished steps.
        with stop_on_interrupt(), contextlib.suppress(KeyboardInterrupt):
            decode(pair, prompt[0].tolist(), tokens, settings, steps, progress)
    finally:
        pair.close()
    if not steps:
        raise Interrupted("record --draft: interrupted before the first verification step finished")
    produced = sum(len(s.accepted_rows) for s in steps)
    return build_trace(spec, prompt, steps, settings, predictor is not None, seed=seed, recorded={
        "tool": f"moesim {__version__}",
        "how": "recorded from a real target/draft pair (transformers reference classes, target router modules "
               "hooked, tree verification in one pass with a 4D attention mask); routing only, no timings",
        "model_name": spec.name, "model_source": str(target_dir), "revision_sha256": revision_hash(target_dir),
        "draft_name": dcfg.get("_name_or_path") or draft_dir.name, "draft_source": str(draft_dir),
        "draft_revision_sha256": revision_hash(draft_dir), "prompts": prompt_source or how,
        "decoding": "greedy speculative (output = the target's greedy decode)", "routed_scaling_factor": scale,
        "device": device, "torch": torch.__version__, "transformers": _transformers_version(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"), "interrupted": produced < tokens,
        "wall_s": {"draft": round(sum(s.draft_s for s in steps), 3),
                   "verify": round(sum(s.verify_s for s in steps), 3),
                   "note": "reference classes, not the offload engine: not a timing to replay"},
    })


# --------------------------------------------------------------------------------------
# The trace
# --------------------------------------------------------------------------------------


def build_trace(spec: ModelSpec, prompt: torch.Tensor, steps: list[VerifiedStep], st: DraftSettings, has_pred: bool,
                seed: int, recorded: dict) -> Trace:
    """Version 2: the accepted rows' routing as the main arrays, one ``sd_*`` record per step."""
    m, e, k = spec.n_moe_layers, spec.n_experts, spec.top_k
    encoded, ids, gates, toks = [], [], [], []
    hits = np.zeros(m)
    seen = 0
    for s in steps:
        node_pred = (np.stack([expert_mask(x, e) for x in s.tree.experts]) if has_pred
                     else np.zeros((len(s.tree), m, e), bool))
        root_pred = expert_mask(s.root_experts, e) if has_pred else np.zeros((m, e), bool)
        encoded.append(SDStep(tokens=list(s.tree.tokens), parents=list(s.tree.parents), prob=list(s.tree.prob),
                              chosen=list(s.chosen), accepted=len(s.accepted_rows), node_pred=node_pred,
                              root_pred=root_pred, row_true=s.row_ids.astype(np.int16)))
        for r in s.accepted_rows:
            ids.append(s.row_ids[r])
            gates.append(s.row_gates[r])
            toks.append(s.row_tokens[r])
        if has_pred:  # recall@k of the predictor over every verified row
            preds = [root_pred] + [node_pred[c] for c in s.chosen]
            for row, mask in zip(s.row_ids, preds, strict=True):
                hits += np.take_along_axis(mask, row.astype(np.int64), -1).mean(-1)
                seen += 1
    true_ids = np.stack(ids)[:, :, None, :].astype(np.int16)  # [T, M, 1, k]
    true_gates = np.clip(np.stack(gates)[:, :, None, :], 0, 1).astype(np.float32)
    n = len(steps)
    timings = {**sd_arrays(encoded, m, e, k), "sd_draft_s": np.zeros(n), "sd_verify_s": np.zeros(n),
               "sd_attn_s": np.zeros((n, spec.n_layers)), "sd_expert_s": np.zeros((n, m)),
               "sd_stall_s": np.zeros((n, m))}
    metrics: dict[str, Any] = {"tokens_per_step": float(true_ids.shape[0] / n),
                               "rows_per_step": float(np.mean([1 + len(s.chosen) for s in steps]))}
    if has_pred:
        metrics["sd_predictor_recall"] = (hits / max(seen, 1)).tolist()
    header = make_header(
        spec, policy="none", params={"temperature": 0.0}, prompt_len=int(prompt.shape[1]),
        n_tokens=int(true_ids.shape[0]), batch=1, seed=seed, synthetic=False, recorded=recorded, metrics=metrics,
        speculative={"gamma": st.budget, "branch": st.branch, "depth": st.depth, "strategy": st.selection,
                     "score": st.score, "lambda": st.lam, "draft": recorded["draft_name"],
                     "predictor": PREDICTOR_FILE if has_pred else "none",
                     "note": "recorded HF target/draft pair: main arrays hold the accepted rows' real routing; sd_* one "
                             "record per verification step with every verified row's real routing; sd_*_s zero "
                             "(nothing measured)"},
    )
    return Trace(header, prompt.numpy().astype(np.int32), np.array([toks], np.int32), true_ids, true_gates,
                 np.full(true_ids.shape, -1, np.int16), np.zeros_like(true_gates), true_ids.copy(), timings)


def record_speculative_trace(target_dir: str | Path, draft_dir: str | Path, out: str | Path, prompts: Any,
                             **kw: Any) -> Trace:
    """``moesim record TARGET --draft DRAFT``: :func:`record_speculative`, then write atomically."""
    check_output_file(out, (".npz",))  # before the models load, not after the run
    trace = record_speculative(target_dir, draft_dir, prompts, **kw)
    write_trace(trace, out)
    return trace
