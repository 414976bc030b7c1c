"""``selective:knapsack``: every block's knapsack at the largest common byte target whose plan
fits, each block's frontier built once (the strategy once rebuilt it per block and target)."""

from __future__ import annotations

import pytest

from remat.plan.planners import plan
from remat.plan.policies import knapsack, knapsack_frontier
from remat.plan.predict import predict
from remat.plan.types import Segment

from measured_models import gpt_profile


def test_knapsack_strategy_is_the_largest_target_that_fits():
    prof = gpt_profile(num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
    # the definition, the slow way: `knapsack` of every block at every target, by rising target
    targets = sorted({w for b in prof.blocks for w, _, _ in knapsack_frontier(b)})
    layouts = [tuple(Segment(start=b.index, stop=b.index + 1, strategy="selective:knapsack",
                             saved_ops=knapsack(b, target_bytes=t)) for b in prof.blocks) for t in targets]
    peaks = [predict(prof, segs).peak_bytes for segs in layouts]
    budgets = sorted({peaks[k] + d for k in range(0, len(peaks), max(1, len(peaks) // 8)) for d in (-1, 0, 1)})
    assert len({tuple(s.saved_ops for s in layouts[k]) for k in range(len(layouts))}) >= 8
    checked = 0
    for budget in budgets:
        fitting = [k for k, peak in enumerate(peaks) if peak <= budget]
        if not fitting:
            continue
        got = plan(prof, budget, strategy="selective:knapsack", head="keep")
        assert got.segments == layouts[fitting[-1]], budget
        assert got.prediction.peak_bytes <= budget
        checked += 1
    assert checked >= 8
