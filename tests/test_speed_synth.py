"""The synthetic generator's threads (issue 25): MoE layers drawn in groups on several
threads give the trace of one thread, bit for bit, whatever the split, chunking and
parameters. Speed itself is measured by bench/bench_sim.py."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
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


def test_sort8_sorts_every_0_1_input_descending():
    """The zero-one principle (Knuth, TAOCP vol. 3, 5.3.4): a network that sorts every 0/1
    input sorts every input; its layers' exchanges touch distinct values (one assignment a layer)."""
    import itertools

    for layer in synthetic.SORT8:
        assert len({i for pair in layer for i in pair}) == 2 * len(layer)
    for bits in itertools.product((0, 1), repeat=8):
        z = list(bits)
        for layer in synthetic.SORT8:
            for a, b in layer:
                z[a], z[b] = max(z[a], z[b]), min(z[a], z[b])
        assert z == sorted(bits, reverse=True)


@pytest.mark.slow  # compiles a second kernel: ~17 s on the 2-core machine
def test_the_written_out_sort8_draws_what_the_transposition_sort_draws():
    """The kernel's unrolled network (k = 8) against its general sort on the same streams."""
    import inspect

    from numba import njit

    src = inspect.getsource(synthetic._draw_rows)
    assert src.count("if k == 8:") == 1
    ns = {"np": np}
    exec(src.replace("if k == 8:", "if k == -8:"), ns)  # noqa: S102 (the kernel's own source, one branch off)
    general = njit(nogil=True)(ns["_draw_rows"])
    spec, params = get_model("qwen3-30b-a3b"), SyntheticParams(tokens=64, seed=3)
    out = []
    for kernel in (synthetic._kernel(), general):
        d = synthetic._Draws(spec, params)
        arrays = [np.empty(d.shape, dt) for dt in synthetic.DRAWN]
        prev = np.zeros(d.shape[1:], np.int16)
        kernel(*arrays, prev, 0, 0, d.shape[1], *d.tables, *[s.copy() for s in d.states], *synthetic._ZIGGURAT)
        out.append(arrays)
    assert spec.top_k == 8
    for a, b in zip(*out):
        assert a.tobytes() == b.tobytes()
    assert (np.diff(out[0][1], axis=-1) <= 0).all()  # gates largest first
