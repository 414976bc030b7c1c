"""Selective and optimal plans on a small GPT: the measured peak (remat.verify) matches the
predicted one, and a plan predicted to fit its budget never exceeds it.

Tolerance: 1% of the predicted peak (the issue asks for 2%). Both sides are exact live-storage
accounts on the CPU, so what is left is bookkeeping the model does not see at all.
"""

import dataclasses

import pytest
import torch

from remat.measure.profile import profile
from remat.models import load_target
from remat.plan.planners import make_plan, plan
from remat.plan.search import OptimalSearch
from remat.verify import verify

TOLERANCE = 0.01
SIZES = {"num_layers": 3, "d_model": 32, "num_heads": 2, "seq_len": 32, "batch_size": 4}


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    built = load_target("gpt", seed=0, **SIZES)
    return built, profile(built.model, built.batch, built.loss_fn, built.optimizer)


def _budgets(prof):
    """A quarter and three fifths of the way from the least feasible peak to the baseline's."""
    floor = make_plan(prof, OptimalSearch(prof).min_peak_segments(), "optimal", None).prediction.peak_bytes
    top = plan(prof, None, "none").prediction.peak_bytes
    return [int(floor + f * (top - floor)) for f in (0.25, 0.6)]


def _check(built, chosen):
    result = verify(built.model, built.batch, chosen, built.loss_fn, built.optimizer, repeats=1)
    # a chunked head (the optimal planner may choose one) reorders the sums of the loss and the
    # projection's gradient, within its stated tolerance; every other plan is bit-identical
    assert result.grads_identical if chosen.head == "keep" else result.ok
    assert result.recompute_counts_match
    assert abs(result.measured_peak_bytes - result.predicted_peak_bytes) <= TOLERANCE * result.predicted_peak_bytes
    if chosen.budget_bytes is not None and result.predicted_peak_bytes <= chosen.budget_bytes:
        assert result.measured_peak_bytes <= chosen.budget_bytes
    return result


def _flop_priced(block):
    total = sum(op.flops for op in block.ops)
    ops = tuple(dataclasses.replace(op, time_ms=block.fwd_ms * op.flops / total) for op in block.ops)
    return dataclasses.replace(block, ops=ops, selective_overhead_ms=0.0, selective_cache_overhead_ms=0.0)


@pytest.mark.parametrize("strategy", ["selective:attention-core", "selective:save-matmuls"])
def test_named_policy_peak_matches(gpt, strategy):
    built, prof = gpt
    _check(built, plan(prof, None, strategy))


def test_optimal_peak_matches_and_fits_at_two_budgets(gpt):
    built, prof = gpt
    # Priced with its measured dispatch overhead, selective loses to recomputation on this small
    # GPT, and which options win depends on op times measured on a busy machine. Priced without
    # the overheads and with each op's time its share of the block's FLOPs, the planner picks
    # knapsack options (the cheap ops replay for nothing) whatever the machine did: their peaks
    # are what this test is about.
    prof = dataclasses.replace(prof, blocks=tuple(_flop_priced(b) for b in prof.blocks))
    kinds = set()
    for budget in _budgets(prof):
        chosen = plan(prof, budget, "optimal")
        assert chosen.prediction.peak_bytes <= budget
        _check(built, chosen)
        kinds |= {s.kind for s in chosen.segments}
    assert "selective" in kinds  # the knapsack options are what this test is about
