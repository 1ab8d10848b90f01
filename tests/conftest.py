"""Shared fixtures: small models and traces that every test can afford."""

from __future__ import annotations

import gc
import signal

import numpy as np
import pytest

from moesim.models import Attention, ModelSpec, get_model
from moesim.traces.format import Trace
from moesim.traces.header import make_header
from moesim.traces.synthetic import SyntheticParams, synthetic_trace

# The tests that press Ctrl-C send SIGINT to a moesim they started, as a terminal does to a
# process whose SIGINT is the default. A suite started as a background job of a script
# (`python -m pytest &`: bash, without job control, starts such commands with SIGINT and
# SIGQUIT ignored, and an ignored signal stays ignored across fork and exec) passed that on
# to every moesim it started, which then ignored the Ctrl-C, as it should, and ran to the
# end: the pool-sweep interrupt tests failed in a load run for that reason alone. A handler
# installed here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="module")
def _collector_sees_only_this_module():
    """Every object alive when a test module starts (pytest, the collected tests, torch,
    transformers...) frozen out of the cyclic collector's reach (gc.freeze) until the
    module ends. The executor collects before each timed decode
    (moesim.executor.profile.collector_paused): in the suite's process that full collection
    walked about a million objects, 0.25 s a call, a third of the executor tests' time. A
    module's own garbage is still collected as before; the next module's full collection
    (after gc.unfreeze) finds what the previous one left."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def two_layer_spec() -> ModelSpec:
    """Two MoE layers of 4 experts, top-2; an expert is 3 * 8 * 4 * 2 = 192 bytes."""
    return ModelSpec("two", n_layers=2, n_experts=4, top_k=2, hidden=8, expert_inter=4, vocab=16,
                     attention=Attention("gqa", 2, 1, 4))


def hand_trace(spec: ModelSpec, true: list, pred: list) -> Trace:
    """A one-sequence trace from nested lists [step][layer][k] of expert ids."""
    true_ids = np.array(true, np.int16)[:, :, None, :]
    pred_ids = np.array(pred, np.int16)[:, :, None, :]
    t = true_ids.shape[0]
    gates = np.full(true_ids.shape, 1 / spec.top_k, np.float32)
    header = make_header(spec, policy="none", prompt_len=0, n_tokens=t, batch=1, seed=0, synthetic=True,
                         recorded={"tool": "tests/conftest.py", "how": "hand-written"})
    return Trace(header, np.zeros((1, 0), np.int32), np.zeros((1, t), np.int32), true_ids, gates, pred_ids,
                 np.where(pred_ids >= 0, gates, 0).astype(np.float32), true_ids.copy())


@pytest.fixture
def tiny_trace() -> Trace:
    return synthetic_trace(get_model("tiny"), SyntheticParams(tokens=24, prompt_len=8, seed=3))


@pytest.fixture
def qwen_trace() -> Trace:
    return synthetic_trace(get_model("qwen3-30b-a3b"), SyntheticParams(tokens=16, prompt_len=32, seed=1))


@pytest.fixture(scope="module")
def refusal_dir(tmp_path_factory):
    """A folder for commands that should be refused: a tiny trace ``t.npz``, a plain file
    ``afile`` and a folder ``adir`` (what a path option may wrongly name)."""
    from moesim.traces.format import write_trace

    d = tmp_path_factory.mktemp("refusals")
    write_trace(synthetic_trace(get_model("tiny"), SyntheticParams(tokens=6, prompt_len=4)), d / "t.npz")
    (d / "afile").write_text("x")
    (d / "adir").mkdir()
    return d
