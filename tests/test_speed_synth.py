"""The synthetic generator's threads (issue 25): MoE layers drawn in groups on several
threads give the trace of one thread, bit for bit, whatever the split, chunking and
parameters. Speed itself is measured by bench/bench_sim.py."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moesim.models import get_model
from moesim.traces import synthetic
from moesim.traces.format import ROUTING
from moesim.traces.synthetic import SyntheticParams, synthetic_trace


@contextmanager
def generator(threads: int, scratch: int):
    """Draw on ``threads`` threads (whatever the trace's size), ``scratch`` slots a chunk."""
    old = synthetic._threads, synthetic.PARALLEL_MIN, synthetic.SCRATCH
    synthetic._threads, synthetic.PARALLEL_MIN, synthetic.SCRATCH = (lambda: threads), 0, scratch
    try:
        yield
    finally:
        synthetic._threads, synthetic.PARALLEL_MIN, synthetic.SCRATCH = old


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["tiny", "olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b"]), st.integers(1, 40),
       st.integers(1, 3), st.integers(2, 5), st.integers(1, 5000), st.floats(0, 3), st.floats(0, 1),
       st.integers(1, 2), st.integers(0, 99))
def test_threads_draw_the_one_thread_trace(model, tokens, batch, threads, scratch, skew, reuse, lookahead, seed):
    spec = get_model(model)
    params = SyntheticParams(tokens=tokens, batch=batch, skew=skew, reuse=reuse, seed=seed,
                             lookahead=min(lookahead, spec.n_moe_layers - 1) or 1)
    with generator(1, 1 << 22):
        one = synthetic_trace(spec, params)
    with generator(threads, scratch):
        many = synthetic_trace(spec, params)
    for name in ROUTING:
        np.testing.assert_array_equal(getattr(many, name), getattr(one, name), err_msg=name)
    np.testing.assert_array_equal(many.token_ids, one.token_ids)
