"""The executor's named defaults, importable without torch (the CLI shows them in --help).

``DECODE_THREADS``: torch compute threads while decoding is timed; the other core is left
to the emulated link's copy thread (a copy thread starved of a core would look like a slow
link). ``OFFLINE_THREADS``: threads for untimed jobs (calibration, estimator and
expert-predictor training).
"""

from moesim.errors import MoesimError
from moesim.models import DRAFT_MODEL, SHIPPED_MODEL, Attention, ModelSpec  # noqa: F401 (the shipped checkpoints' names)

DECODE_THREADS = 1
OFFLINE_THREADS = 2
#: Tokens a chunk the expert predictor reads through draft and target (so the least it trains or scores on).
PREDICTOR_CHUNK = 256
#: ``moesim record --draft``: the candidate tree and the selection (DraftSettings' defaults).
RECORD_DRAFT = {"depth": 3, "branch": 2, "budget": 4, "selection": "confidence", "score": "ratio", "lam": 0.1}

#: Where the learned-routing geometries' weights come from (``moesim train``).
STDLIB_SOURCE = "trained by moesim (executor/train.py) on the Python standard library's source"


def stdlib_spec(name: str = "moe-stdlib", layers: int = 4, experts: int = 32, top_k: int = 4, hidden: int = 128,
                inter: int = 64, heads: int = 4) -> ModelSpec:
    """A byte-level Qwen3-MoE-style geometry (the shipped model's by default; the draft's
    smaller): torch-free, so ``moesim train`` estimates a run before the executor loads."""
    return ModelSpec(name, n_layers=layers, n_experts=experts, top_k=top_k, hidden=hidden, expert_inter=inter,
                     vocab=256, attention=Attention("gqa", heads, max(1, heads // 2), hidden // heads, qk_norm=True),
                     norm_topk_prob=True, source=STDLIB_SOURCE)


def check_predictor_counts(tokens: int, eval_tokens: int, epochs: int) -> None:
    """The expert predictor's token counts and epochs, refused before torch loads (one line)."""
    if min(tokens, eval_tokens) < PREDICTOR_CHUNK or epochs < 1:
        raise MoesimError(f"--tokens {tokens}, --eval-tokens {eval_tokens}, --epochs {epochs}: the tokens must be >= "
                          f"{PREDICTOR_CHUNK} (the predictor reads {PREDICTOR_CHUNK}-token chunks) and the epochs >= 1")


def check_calibrate_tokens(tokens: int) -> None:
    """``calibrate --tokens``, refused before torch loads."""
    if tokens < 2:
        raise MoesimError(f"--tokens {tokens}: calibrate on at least 2 tokens")


def check_estimator_counts(tokens: int, eval_tokens: int, epochs: int, width: int, lr: float) -> None:
    """``train-estimator``'s counts and learning rate, refused before torch loads."""
    if min(tokens, eval_tokens, epochs, width) < 1 or not 0 < lr < float("inf"):
        raise MoesimError(f"--tokens {tokens}, --eval-tokens {eval_tokens}, --epochs {epochs}, --width {width}, "
                          f"--lr {lr:g}: the counts must be >= 1 and lr a positive number")
