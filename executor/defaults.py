"""The executor's named defaults, importable without torch (the CLI shows them in --help).

``DECODE_THREADS``: torch compute threads while decoding is timed; the other core is left
to the emulated link's copy thread (a copy thread starved of a core would look like a slow
link). ``OFFLINE_THREADS``: threads for untimed jobs (calibration, estimator and
expert-predictor training).
"""

from moesim.models import DRAFT_MODEL, SHIPPED_MODEL  # noqa: F401 (the shipped checkpoints' names)

DECODE_THREADS = 1
OFFLINE_THREADS = 2
#: ``moesim record --draft``: the candidate tree and the selection (DraftSettings' defaults).
RECORD_DRAFT = {"depth": 3, "branch": 2, "budget": 4, "selection": "confidence", "score": "ratio", "lam": 0.1}
