"""The neural expert estimator and the hybrid predictor.

Router-based prediction (layer l+1's router applied to the quasi-hidden state ``q_l``)
fails on layers whose residual stream drifts. The estimator is a small feed-forward
network with a learned per-layer position embedding that maps ``q_l`` to layer l+1's
router logits, trained by distillation: KL divergence to the true router's distribution,
on activations of the learned-routing model. The hybrid predictor uses, per layer,
whichever of router-based and estimator prediction had the higher recall@k on held-out
text; the choice is stored with the estimator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save
from torch import Tensor, nn

from moesim.atomic import atomic_write, atomic_write_text
from moesim.errors import MoesimError
from moesim.executor.interrupt import Interrupted, stop_on_interrupt, stop_requested
from moesim.executor.model import Hooks, MoEModel, ResidentExperts, quasi_hidden, read_tensors

ESTIMATOR_FILE = "estimator.safetensors"
RECORD_FILE = "estimator.json"


class Estimator(nn.Module):
    """``logits_{l+1} = W2 silu(W1 (q_l + pos[l]))``."""

    def __init__(self, hidden: int, n_experts: int, n_layers: int, width: int = 256) -> None:
        super().__init__()
        self.pos = nn.Embedding(n_layers, hidden)
        self.up = nn.Linear(hidden, width)
        self.down = nn.Linear(width, n_experts)
        nn.init.zeros_(self.pos.weight)

    def forward(self, q: Tensor, layer: int | Tensor) -> Tensor:
        pos = self.pos.weight[layer]
        return self.down(F.silu(self.up(q + pos)))


@torch.no_grad()
def collect(model: MoEModel, dv: Tensor, tokens: Tensor, chunk: int = 256) -> tuple[Tensor, Tensor, Tensor]:
    """Run ``tokens`` through the model; for every layer l < L-1 and token, the quasi-hidden
    state ``q_l`` and layer l+1's true router probabilities. Returns (q, probs, layer index)."""
    s = model.spec
    qs, ps, ls = [], [], []
    prev: list[Tensor] = []  # q_{l-1}, waiting for layer l's true router

    def capture(layer: int, x: Tensor, logits: Tensor, resid: Tensor, ids: Tensor, gates: Tensor) -> None:
        if prev:
            qs.append(prev.pop())
            ps.append(logits.float().softmax(-1))
            ls.append(torch.full((x.shape[0],), layer - 1, dtype=torch.long))
        if layer + 1 < s.n_layers:
            prev.append(quasi_hidden(model, layer, resid, ids, gates, dv).float())

    hooks = Hooks(ResidentExperts(model, on_route=capture), logits="none")  # the routers are all it reads
    for i in range(0, tokens.numel() - 1, chunk):
        if stop_requested():  # Ctrl-C: the caller writes nothing from a partial collection
            break
        model(tokens[i:i + chunk].view(1, -1), hooks=hooks)
    if not qs:
        return torch.empty(0, s.hidden), torch.empty(0, s.n_experts), torch.empty(0, dtype=torch.long)
    return torch.cat(qs), torch.cat(ps), torch.cat(ls)


def recall_by_layer(pred_logits: Tensor, true_probs: Tensor, layers: Tensor, n_layers: int, k: int) -> list[float]:
    """recall@k of top-k(pred) against top-k(true) per source layer (index l predicts l+1)."""
    p = pred_logits.topk(k, -1).indices
    t = true_probs.topk(k, -1).indices
    hit = (p[:, :, None] == t[:, None, :]).any(-1).float().mean(-1)
    return [float(hit[layers == layer].mean()) for layer in range(n_layers - 1)]


@dataclass(frozen=True)
class EstimatorTraining:
    """How the estimator is distilled: ``epochs`` over the collected activations in batches
    of ``batch`` rows, a hidden ``width``, AdamW at ``lr``, ``seed`` for the weights and the
    order (``moesim train-estimator``'s options)."""

    epochs: int = 6
    width: int = 256
    lr: float = 3e-3
    batch: int = 1024
    seed: int = 0


DEFAULT_ESTIMATOR_TRAINING = EstimatorTraining()


def train_estimator(model: MoEModel, dv: Tensor, train_tokens: Tensor, eval_tokens: Tensor, out_dir: Path,
                    cfg: EstimatorTraining = DEFAULT_ESTIMATOR_TRAINING,
                    progress: Callable[[int, int, float], None] | None = None) -> dict:
    """Distil the routers into an estimator as ``cfg`` says; evaluate on held-out text and
    checkpoint (the estimator and its record, with the hybrid choice) after every epoch and
    on Ctrl-C, so an interrupted run keeps a loadable estimator that says how far it trained."""
    epochs, width, lr, batch, seed = cfg.epochs, cfg.width, cfg.lr, cfg.batch, cfg.seed
    torch.manual_seed(seed)
    s = model.spec
    t0 = time.time()
    with stop_on_interrupt():
        q, p, lay = collect(model, dv, train_tokens)
        qe, pe, le = collect(model, dv, eval_tokens)
        if stop_requested():
            raise Interrupted("interrupted while collecting activations: nothing written")
        collect_s = time.time() - t0
        est = Estimator(s.hidden, s.n_experts, s.n_layers, width)
        opt = torch.optim.AdamW(est.parameters(), lr=lr, weight_decay=0.01)
        n = q.shape[0]
        steps = epochs * (n // batch)
        with torch.no_grad():  # the router-based (quasi-hidden) baseline on the same held-out states
            router_recall = []
            for layer in range(s.n_layers - 1):
                sel = le == layer
                logits = model.layers[layer + 1].mlp.gate(qe[sel].to(model.embed_tokens.weight.dtype)).float()
                router_recall += recall_by_layer(logits, pe[sel], torch.zeros(int(sel.sum()), dtype=torch.long), 2,
                                                 s.top_k)
        curve: list[dict] = []
        step = 0
        gen = torch.Generator().manual_seed(seed)

        def checkpoint(epoch: int) -> dict:
            """Evaluate, then write the estimator and its record (each atomically)."""
            with torch.no_grad():
                ev = est(qe, le)
                eval_kl = float(F.kl_div(ev.log_softmax(-1), pe, reduction="batchmean"))
            curve.append({"epoch": epoch, "steps": step, "training_tokens": step * batch // (s.n_layers - 1),
                          "training_examples": step * batch, "eval_kl": eval_kl,
                          "recall_at_k": recall_by_layer(ev, pe, le, s.n_layers, s.top_k)})
            final = curve[-1]["recall_at_k"]
            record = {
                "command": f"moesim train-estimator --epochs {epochs} --width {width} --lr {lr} --batch {batch} "
                           f"--seed {seed}",
                "parameters": sum(p_.numel() for p_ in est.parameters()), "width": width, "epochs": epochs,
                "train_examples": n, "eval_examples": int(qe.shape[0]), "train_tokens": int(train_tokens.numel()),
                "eval_tokens": int(eval_tokens.numel()), "collect_seconds": round(collect_s, 1),
                "train_seconds": round(time.time() - t0 - collect_s, 1),
                "router_recall_at_k": router_recall, "estimator_recall_at_k": final,
                "hybrid": ["estimator" if e > r else "quasi" for e, r in zip(final, router_recall, strict=True)],
                "curve": curve,
                "note": "recall at index l: predicting layer l+1 from layer l's quasi-hidden state (held-out text)",
                **({"status": f"stopped by Ctrl-C after {step} of {steps} steps"} if step < steps else {}),
            }
            save_estimator(out_dir, est)
            atomic_write_text(out_dir / RECORD_FILE, json.dumps(record, indent=2) + "\n")
            return record

        record = None
        for epoch in range(epochs):
            perm = torch.randperm(n, generator=gen)
            start = step
            for i in range(0, n - batch + 1, batch):
                if stop_requested():
                    break
                idx = perm[i:i + batch]
                logits = est(q[idx], lay[idx])
                loss = F.kl_div(logits.log_softmax(-1), p[idx], reduction="batchmean")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                if progress:
                    progress(step, steps, loss.item())
            if step > start:  # nothing new since the last checkpoint otherwise
                record = checkpoint(epoch + 1)
            if stop_requested():
                break
    if record is None:
        raise Interrupted("interrupted before the first training step: nothing written")
    return record


def save_estimator(model_dir: Path, est: Estimator) -> None:
    meta = {"hidden": str(est.up.in_features), "width": str(est.up.out_features), "experts": str(est.down.out_features),
            "layers": str(est.pos.num_embeddings)}
    data = save({k: v.contiguous() for k, v in est.state_dict().items()}, metadata=meta)
    atomic_write(model_dir / ESTIMATOR_FILE, lambda f: f.write(data))


def load_estimator(model_dir: Path) -> tuple[Estimator, list[str]] | None:
    """(estimator, hybrid choice per layer) stored beside a model, or None."""
    found = read_tensors(Path(model_dir) / ESTIMATOR_FILE)
    if found is None:
        return None
    state, meta = found
    est = Estimator(int(meta["hidden"]), int(meta["experts"]), int(meta["layers"]), int(meta["width"]))
    est.load_state_dict(state)
    rec_path = Path(model_dir) / RECORD_FILE
    if not rec_path.exists():
        raise MoesimError(f"{model_dir}: {ESTIMATOR_FILE} without {RECORD_FILE}")
    return est.eval(), json.loads(rec_path.read_text())["hybrid"]
