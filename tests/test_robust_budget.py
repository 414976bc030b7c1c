"""A budget that keeping every block fits exactly (``"100%"`` of the measured baseline peak, or
the no-recomputation plan's predicted peak) gets no recomputation, on both of the optimal
search's paths (bytes counted exactly, and slots on chains longer than EXACT_MAX_BLOCKS); one
byte less does need recomputation."""

from __future__ import annotations

import functools

import pytest
import torch

import remat
from remat.models import build
from remat.plan.planners import plan as make_plan
from remat.plan.search import EXACT_MAX_BLOCKS

SIZES = {
    "exact": {"depth": 4, "width": 16, "batch_size": 256},
    "slots": {"depth": EXACT_MAX_BLOCKS + 2, "width": 16, "batch_size": 32},
}


@functools.cache
def _profile(path: str):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        built = build("mlp", **SIZES[path])
        return remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", sorted(SIZES))
def test_a_budget_that_keeping_everything_fits_gets_no_recomputation(path):
    prof = _profile(path)
    none = make_plan(prof, strategy="none")
    assert none.prediction.peak_bytes == prof.peak_bytes  # the measured baseline, predicted exactly
    for budget in ("100%", prof.peak_bytes, none.prediction.peak_bytes):
        chosen = make_plan(prof, budget=budget, strategy="optimal")
        assert chosen.block_strategies() == ("keep",) * prof.num_blocks and chosen.head == "keep", budget
        assert chosen.prediction.step_ms == none.prediction.step_ms and chosen.prediction.extra_flops == 0
        assert chosen.optimality.extra_ms == 0.0
        assert chosen.optimality.exact or path == "slots"  # slots bound the gap, not always to 0
    assert (make_plan(prof, budget="100%", strategy="optimal").optimality.quantum_bytes == 1) == (path == "exact")
    tighter = make_plan(prof, budget=none.prediction.peak_bytes - 1, strategy="optimal")
    assert "recompute" in tighter.block_strategies() or tighter.head != "keep"
    assert tighter.prediction.peak_bytes < none.prediction.peak_bytes
