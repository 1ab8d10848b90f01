"""Copies as the engine issues them (issue 62): a figure read from the engine's source prices
what its copies cost beyond the bytes."""

from __future__ import annotations

from moesim.costmodel import CostModel
from moesim.engines import get_engine
from moesim.hardware import get_machine
from moesim.models import get_model


def _copy(engine) -> float:
    spec, gpu = get_model("mixtral-8x7b"), get_machine("a6000").gpus[0]
    return CostModel(spec, gpu, engine=engine).copy_expert()


def test_an_engine_that_copies_the_evicted_expert_back_pays_both_copies_in_turn():
    """mixtral-offloading's ExpertCache._swap copies the expert in and the evicted one out on
    one CUDA stream: a miss costs two copies of an expert, one after the other."""
    mixoff = get_engine("mixtral-offloading")
    assert mixoff.get("evicted_copy_back") == 1 and "ExpertCache._swap" in mixoff.figures["evicted_copy_back"].source
    without = mixoff.with_figure("evicted_copy_back", 0, "estimate", "test")
    assert _copy(mixoff) == 2 * _copy(without)
    eager = get_engine("pytorch-eager")  # the reference executor's engine keeps its host copy: one copy a miss
    assert eager.get("evicted_copy_back", 0) == 0 and _copy(eager) < _copy(mixoff)
