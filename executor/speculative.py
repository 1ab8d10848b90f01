"""Speculative decoding on the offload engine, with cost-aware tree selection (EcoSpec).

(Speculative DECODING: a draft proposes tokens, the target verifies them. Not the
speculative EXECUTION of the ``prefetch-spec`` policy, which runs predicted experts.)

Each step: the draft model grows a candidate tree (top-``branch`` children per node to
``depth``); a selection strategy picks ``gamma`` nodes that keep a tree; the target
verifies the root (the last committed token) and the chosen nodes in one pass with a tree
attention mask, loading per layer the union of their experts; greedy acceptance walks
the tree along the target's own argmax, so the output equals plain greedy decoding; the
KV cache keeps only the accepted path.

Selection (confidence-only or EcoSpec) and greedy acceptance are plain decisions in
``moesim/selection.py``, shared with the simulator's what-if.

The expert predictor maps the draft's final hidden state of a node to each target
layer's router logits (one linear probe per layer, distilled like the estimator).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save
from torch import Tensor, nn

from moesim import __version__
from moesim.atomic import atomic_write, atomic_write_text
from moesim.errors import MoesimError
from moesim.executor.defaults import PREDICTOR_CHUNK
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.model import Hooks, MoEModel, ResidentExperts, TreeMask, read_tensors
from moesim.executor.runtime import OffloadedDecoder, Origin
from moesim.selection import SCORES, SELECTIONS, Tree, accept, check_lambda, select
from moesim.traces.format import Trace
from moesim.traces.header import make_header
from moesim.traces.records import SDStep, copy_arrays, expert_mask, sd_arrays

__all__ = ["SCORES", "SELECTIONS", "Tree", "accept", "select"]  # the shared decisions, re-exported
PREDICTOR_FILE = "expert_predictor.safetensors"


# --------------------------------------------------------------------------------------
# The expert predictor: draft hidden state -> target router logits, per layer
# --------------------------------------------------------------------------------------


class ExpertPredictor(nn.Module):
    def __init__(self, draft_hidden: int, target_layers: int, n_experts: int) -> None:
        super().__init__()
        self.probes = nn.Linear(draft_hidden, target_layers * n_experts)
        self.layers, self.experts = target_layers, n_experts

    def forward(self, h: Tensor) -> Tensor:
        """[n, draft_hidden] -> router logits [n, target_layers, experts]."""
        return self.probes(h).view(h.shape[0], self.layers, self.experts)


@torch.no_grad()
def draft_hidden(draft: MoEModel, tokens: Tensor, tree: TreeMask | None = None, cache=None,
                 start: int = 0) -> tuple[Tensor, Tensor]:
    """Draft forward over ``tokens`` [1, t] (after ``start`` cached tokens when ``cache``):
    (logits [t, V], final normed hidden [t, d])."""
    hn = draft(tokens, cache, start, Hooks(tree=tree, logits="none"))[0]  # [t, d]
    return draft.lm_head(hn), hn


class DraftState:
    """The draft's KV cache over the committed text: each step feeds only what was
    committed since, then reads the tree against it (tree keys are written past the
    committed ones and overwritten by the next step)."""

    def __init__(self, draft: MoEModel, max_len: int) -> None:
        self.draft, self.cache, self.n = draft, draft.new_cache(1, max_len), 0
        self.last: tuple[Tensor, Tensor] | None = None  # (logits, hidden) of the last committed token

    def advance(self, committed: list[int]) -> None:
        new = torch.tensor(committed[self.n:], dtype=torch.long).view(1, -1)
        logits, hidden = draft_hidden(self.draft, new, None, self.cache, self.n)
        self.n = len(committed)
        self.last = (logits[-1], hidden[-1])

    def tree(self, tokens: list[int], parents: list[int]) -> tuple[Tensor, Tensor]:
        tm = TreeMask.from_parents(parents, self.n)
        return draft_hidden(self.draft, torch.tensor([tokens]), tm, self.cache, self.n)


@torch.no_grad()
def _target_router_probs(target: MoEModel, tokens: Tensor) -> Tensor:
    """Every target layer's router distribution for each token: [t, layers, experts]."""
    probs: list[Tensor] = []  # per layer [t, experts]
    target(tokens.view(1, -1), hooks=Hooks(ResidentExperts(
        target, on_route=lambda layer, x, logits, *_: probs.append(logits.float().softmax(-1))), logits="none"))
    return torch.stack(probs, 1)


def train_expert_predictor(draft: MoEModel, target: MoEModel, train: Tensor, held_out: Tensor, out_dir: Path,
                           epochs: int = 20, chunk: int = PREDICTOR_CHUNK, lr: float = 3e-3, seed: int = 0,
                           progress: Callable[[int, int], None] | None = None) -> dict:
    """Distil per-layer linear probes (KL to the target routers) and report held-out recall.
    ``progress(done, total)`` counts work units: a chunk read through both models, or a
    training batch."""
    torch.manual_seed(seed)
    t0 = time.time()
    n_chunks = [max(0, (x.numel() - chunk) // chunk + 1) for x in (train, held_out)]
    total = sum(n_chunks) + epochs * -(-n_chunks[0] * chunk // 512)
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    def data(tokens: Tensor) -> tuple[Tensor, Tensor]:
        xs, ys = [], []
        for i in range(0, tokens.numel() - chunk + 1, chunk):
            part = tokens[i:i + chunk]
            xs.append(draft_hidden(draft, part.view(1, -1))[1].float())
            ys.append(_target_router_probs(target, part))
            tick()
        return torch.cat(xs), torch.cat(ys)

    x, y = data(train)
    xe, ye = data(held_out)
    s = target.spec
    pred = ExpertPredictor(draft.spec.hidden, s.n_layers, s.n_experts)
    opt = torch.optim.AdamW(pred.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(epochs):
        for idx in torch.randperm(x.shape[0]).split(512):
            loss = F.kl_div(pred(x[idx]).log_softmax(-1), y[idx], reduction="batchmean")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tick()
    with torch.no_grad():
        top_p = pred(xe).topk(s.top_k, -1).indices
        top_t = ye.topk(s.top_k, -1).indices
        recall = (top_p[..., :, None] == top_t[..., None, :]).any(-1).float().mean((0, 2)).tolist()
    data_ = save({k: v.contiguous() for k, v in pred.state_dict().items()},
                 metadata={"draft_hidden": str(draft.spec.hidden), "layers": str(s.n_layers), "experts": str(s.n_experts)})
    atomic_write(out_dir / PREDICTOR_FILE, lambda f: f.write(data_))
    record = {"recall_at_k": recall, "train_tokens": int(train.numel()), "held_out_tokens": int(held_out.numel()),
              "parameters": sum(p.numel() for p in pred.parameters()), "seconds": round(time.time() - t0, 1),
              "what": "per target layer, recall@k of the experts predicted from the draft's hidden state"}
    atomic_write_text(out_dir / "expert_predictor.json", json.dumps(record, indent=2) + "\n")
    return record


def load_expert_predictor(model_dir: Path) -> ExpertPredictor | None:
    found = read_tensors(Path(model_dir) / PREDICTOR_FILE)
    if found is None:
        return None
    state, meta = found
    pred = ExpertPredictor(int(meta["draft_hidden"]), int(meta["layers"]), int(meta["experts"]))
    pred.load_state_dict(state)
    return pred.eval()


# --------------------------------------------------------------------------------------
# The decoding loop
# --------------------------------------------------------------------------------------


#: Candidates a step a draft tree may have: each is a draft forward pass (a 1000 x 1000 tree
#: overflowed torch's tensor sizes after the models had loaded).
MAX_TREE_NODES = 4096


def check_tree_size(depth: int, branch: int, command: str) -> None:
    """One line, before any model loads, for a tree of more than :data:`MAX_TREE_NODES` candidates."""
    nodes, level = 0, 1
    for _ in range(depth):  # stops early: a 1000 x 1000 tree is never counted out
        level *= branch
        nodes += level
        if nodes > MAX_TREE_NODES:
            raise MoesimError(f"{command}: a tree of depth {depth} and branch {branch} has more than "
                              f"{MAX_TREE_NODES:,} candidates a step, each a draft forward pass; choose a smaller tree")


@dataclass
class SDSettings:
    gamma: int = 4  # candidates verified per step (besides the root)
    branch: int = 2
    depth: int = 3
    strategy: str = "ecospec"
    score: str = "ratio"
    lam: float = 0.1
    tokens: int = 32  # tokens to produce

    def __post_init__(self) -> None:
        if self.gamma < 0 or self.branch < 1 or self.depth < 1 or self.tokens < 1:
            raise MoesimError("gamma >= 0, branch >= 1, depth >= 1, tokens >= 1")
        check_tree_size(self.depth, self.branch, "speculate")
        check_lambda(self.lam)
        if self.strategy not in SELECTIONS:
            raise MoesimError(f"unknown selection {self.strategy!r}; known: {', '.join(SELECTIONS)}")
        if self.score not in SCORES:
            raise MoesimError(f"unknown score {self.score!r}; known: {', '.join(SCORES)}")


@dataclass
class VerifyRecord:
    """One verification step: the candidate tree, what was verified and accepted, experts, times."""

    tree: Tree
    chosen: list[int]
    accepted_rows: list[int]
    new_tokens: list[int]
    true_union: list[set[int]]
    pred_union: list[set[int]]
    draft_s: float
    verify: object  # the runtime's StepRecord of the verification pass
    row_routing: np.ndarray  # [L, rows, k] true ids of every verified row
    row_tokens: list[int]  # the verified rows' tokens: the root, then the chosen candidates
    root_experts: list[set[int]]  # the expert predictor's guess for the root (the buffer's start)


@torch.no_grad()
def build_tree(state: DraftState, predictor: ExpertPredictor | None, branch: int, depth: int,
               k: int) -> tuple[Tree, list[set[int]]]:
    """Grow the candidate tree level by level from the draft's state after the committed
    text. Returns the tree and the root's predicted experts."""
    tree = Tree()
    root_logits, root_hidden = state.last
    root_experts: list[set[int]] = []
    if predictor is not None:
        pred = predictor(root_hidden.float()[None]).topk(k, -1).indices[0]
        root_experts = [set(pred[layer].tolist()) for layer in range(pred.shape[0])]
    frontier, logits, hidden = [-1], None, None
    for level in range(depth + 1):
        if level:  # read the tree so far: logits and hidden of every node
            logits, hidden = state.tree(tree.tokens, tree.parents)
            if predictor is not None:
                pred = predictor(hidden.float()).topk(k, -1).indices
                for i in range(len(tree.experts), len(tree)):
                    tree.experts.append([set(pred[i, layer].tolist()) for layer in range(pred.shape[1])])
        if level == depth:
            break
        new_frontier = []
        for f in frontier:
            probs = (root_logits if f == -1 else logits[f]).float().softmax(-1)
            p, ids = probs.topk(branch)
            base = 1.0 if f == -1 else tree.prob[f]
            for pi, ti in zip(p.tolist(), ids.tolist(), strict=True):
                tree.tokens.append(ti)
                tree.parents.append(f)
                tree.prob.append(base * pi)
                new_frontier.append(len(tree) - 1)
        frontier = new_frontier
    return tree, root_experts


@torch.no_grad()
def sd_generate(decoder: OffloadedDecoder, draft: MoEModel, predictor: ExpertPredictor | None,
                prompt: Tensor, st: SDSettings,
                progress: Callable[[int, int], None] | None = None) -> tuple[float, list[VerifyRecord], list[int]]:
    """Greedy speculative decoding of ``prompt`` [1, P] (batch 1). Returns (prefill seconds,
    verification records, produced tokens). Ctrl-C at any instant keeps the finished
    verification steps (and the tokens they produced); before the first one it raises
    :class:`Interrupted`."""
    target = decoder.model
    if not decoder.policy.exact:  # speculative EXECUTION (prefetch-spec) would verify with predicted experts
        raise MoesimError("speculative decoding verifies exactly: use an exact policy (not prefetch-spec)")
    if prompt.shape[0] != 1:
        raise MoesimError("speculative decoding runs at batch 1")
    if st.strategy == "ecospec" and predictor is None:
        raise MoesimError("ecospec selection needs the expert predictor (moesim train-expert-predictor)")
    s, k = target.spec, target.spec.top_k
    p = prompt.shape[1]
    cache = target.new_cache(1, p + st.tokens + st.depth + st.gamma + 2)
    out: list[int] = []
    committed = prompt[0].tolist()
    pos = p
    records: list[VerifyRecord] = []
    n_tree = sum(st.branch ** d for d in range(1, st.depth + 1))  # candidates a tree can hold
    state = DraftState(draft, p + st.tokens + n_tree + 2)
    cut = False
    with stop_on_interrupt():
        try:
            pre = decoder.step(prompt.to(decoder.device), cache, 0, prefill=True)
            root = int(pre.logits[0].argmax())
            while len(out) < st.tokens:
                if stop_requested():
                    cut = True
                    break
                out.append(root)
                committed.append(root)
                if len(out) >= st.tokens:
                    break
                t0 = time.perf_counter()
                state.advance(committed)
                tree, root_experts = build_tree(state, predictor, st.branch, st.depth, k)
                chosen = select(tree, st.gamma, st.strategy, root_experts or None, st.score, st.lam)
                draft_s = time.perf_counter() - t0
                parents = [-1] + [0 if tree.parents[c] == -1 else 1 + chosen.index(tree.parents[c]) for c in chosen]
                rows = torch.tensor([[root] + [tree.tokens[c] for c in chosen]])
                pred_union = [set(root_experts[layer]) if root_experts else set() for layer in range(s.n_layers)]
                for c in chosen:
                    if tree.experts:
                        for layer in range(s.n_layers):
                            pred_union[layer] |= tree.experts[c][layer]
                tm = TreeMask.from_parents(parents, pos, decoder.device)
                rec = decoder.step(rows.to(decoder.device), cache, pos, step_index=len(records), tree=tm,
                                   predicted=[sorted(u) for u in pred_union] if predictor is not None else None)
                target_next = rec.all_logits[0].argmax(-1).tolist()  # the target's next token after every row
                acc = accept(tree, chosen, target_next)
                cache.keep(pos, acc)
                new = [int(rows[0, r]) for r in acc[1:]]
                true_union = [set(rec.true_ids[layer].reshape(-1).tolist()) for layer in range(s.n_layers)]
                records.append(VerifyRecord(tree, chosen, acc, new, true_union, pred_union, draft_s, rec,
                                            rec.true_ids.copy(), rows[0].tolist(), root_experts))
                out.extend(new)
                committed.extend(new)
                pos += len(acc)
                root = target_next[acc[-1]]
                if progress is not None:
                    progress(min(len(out), st.tokens), st.tokens)
        except KeyboardInterrupt:
            cut = True
        finally:
            decoder.transport.close()
    if cut:  # the tokens of the finished verification steps only: each step's root and what it accepted
        if not records:
            raise Interrupted("interrupted before the first verification step finished: nothing to keep")
        out = [t for r in records for t in (r.row_tokens[0], *r.new_tokens)]
    return pre.tpot_s, records, out[: st.tokens]


@torch.no_grad()
def greedy_reference(target: MoEModel, prompt: Tensor, n: int) -> list[int]:
    """Plain greedy decoding with everything resident: what speculative decoding must equal."""
    cache = target.new_cache(1, prompt.shape[1] + n + 1)
    last = Hooks(logits="last")
    logits = target(prompt, cache, 0, last)  # [1, vocab]
    out, pos = [], prompt.shape[1]
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = target(torch.tensor([[tok]]), cache, pos, last)
        pos += 1
    return out


def build_sd_trace(target: MoEModel, prompt: Tensor, records: list[VerifyRecord], prefill_s: float, hw,
                   st: SDSettings, policy: str, cache_experts: int, origin: Origin, extra: dict | None = None):
    """A version-2 trace: the routing of every accepted row as the main arrays, and one
    record per verification step (tree, choice, acceptance, experts, timings); ``origin``
    names the target's source and the draft's."""
    device, synthetic, source, draft_source = origin.device, origin.synthetic, origin.source, origin.draft
    s = target.spec
    L, E, k = s.n_layers, s.n_experts, s.top_k
    steps, true_rows, token_rows = [], [], []
    for r in records:
        rt = r.row_routing.transpose(1, 0, 2)  # [rows, L, k]
        steps.append(SDStep(tokens=list(r.tree.tokens), parents=list(r.tree.parents), prob=list(r.tree.prob),
                            chosen=list(r.chosen), accepted=len(r.accepted_rows),
                            node_pred=np.stack([expert_mask(ex, E) for ex in r.tree.experts])
                            if len(r.tree) else np.zeros((0, L, E), bool),
                            root_pred=expert_mask(r.root_experts, E), row_true=rt))
        for row in r.accepted_rows:
            true_rows.append(rt[row])
            token_rows.append(r.row_tokens[row])
    vr = [r.verify for r in records]
    true_ids = np.stack(true_rows)[:, :, None, :].astype(np.int16)
    timings = {
        **sd_arrays(steps, L, E, k),
        "sd_draft_s": np.array([r.draft_s for r in records]), "sd_verify_s": np.array([v.tpot_s for v in vr]),
        "sd_attn_s": np.stack([v.attn_s for v in vr]), "sd_expert_s": np.stack([v.expert_s for v in vr]),
        "sd_stall_s": np.stack([v.stall_s for v in vr]),
    }
    timings.update(copy_arrays([(i, c) for i, v in enumerate(vr) for c in v.copies]))
    header = make_header(
        s, policy=policy, params={"cache_experts": cache_experts}, prompt_len=int(prompt.shape[1]),
        n_tokens=int(true_ids.shape[0]), batch=1, seed=0, synthetic=synthetic, prefill_s=prefill_s,
        recorded={"tool": f"moesim {__version__}", "how": "moesim speculate (reference executor)",
                  "hw_profile": hw.name, "link_gbps": hw["h2d_pinned_gbs"], "latency_us": hw["transfer_latency_us"],
                  "device": device, "model_source": source, "torch": torch.__version__},
        metrics=extra or {},
        speculative={"gamma": st.gamma, "branch": st.branch, "depth": st.depth, "strategy": st.strategy,
                     "score": st.score, "lambda": st.lam, "draft": draft_source,
                     "note": "main arrays hold the accepted rows' routing; sd_* one record per verification step"},
    )
    gates = np.full(true_ids.shape, 1.0 / k, np.float32)
    pred = np.full(true_ids.shape, -1, np.int16)
    return Trace(header, prompt.numpy().astype(np.int32), np.array([token_rows], np.int32), true_ids, gates, pred,
                 np.zeros_like(gates), true_ids.copy(), timings)



# Old names, still imported by bench/bench_speculative.py (remove once it uses the new ones).
SpecSettings = SDSettings
speculative_generate = sd_generate
