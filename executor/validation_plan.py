"""What ``moesim validate`` runs, importable without torch: the policies, the prompt, the
synthetic geometry and each model's links and steps. The suite (``moesim.executor.validation``)
runs this plan; ``moesim.reports.validation`` estimates it from here before torch is
imported, so an impossible ``--repeats`` is refused at once, not after the executor loads."""

from __future__ import annotations

from moesim.errors import MoesimError
from moesim.models import SHIPPED_MODEL, Attention, ModelSpec

POLICIES = ("on-demand", "prefetch-fom", "prefetch-spec", "oracle")
SYNTHETIC_SPEC = ModelSpec("synthetic-1024x512", n_layers=6, n_experts=16, top_k=4, hidden=1024, expert_inter=512,
                           vocab=1024, attention=Attention("gqa", 8, 4, 128, qk_norm=True),
                           source="moesim validation geometry with seeded random weights (synthetic)")
PROMPT = b"import os\nimport sys\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
#: (model, link bandwidths in GB/s, steps per run relative to ``--tokens``): bandwidths put
#: copies and compute of each model on the same order on a CPU core; the learned model's steps
#: are ~10x shorter, so it runs 4x as many to average out noise.
SUITE = ((SHIPPED_MODEL, (0.25, 0.5, 1.0), 4), (SYNTHETIC_SPEC.name, (2.0, 4.0, 8.0), 1))


def check_suite_model(model: str | None) -> None:
    """``validate --model``: one of :data:`SUITE`'s models, refused before torch loads if not."""
    names = [name for name, *_ in SUITE]
    if model is not None and model not in names:
        raise MoesimError(f"no suite model called {model!r}; the suite's: {', '.join(names)}")
