"""The search on slots (long chains, or ``max_slots``): what rounding may cost, and the ends it
must not lose.

Slots round every size up, so a budget can lie between what the slot DP accepts and what fits
in bytes. The search checks the two ends with `predict` (keeping every block; the least-peak
layout) and reports how far its plan may be from the best (`Plan.optimality`); a priori, the plan
is no slower in extra time than any layout fitting the budget less `rounding_slack_bytes`.
"""

from __future__ import annotations

import math
import random

import pytest

from remat.plan.planners import plan
from remat.plan.predict import predict
from remat.plan.search import EXACT_MAX_BLOCKS, OptimalSearch
from remat.plan.slots import rounding_slack_bytes
from remat.plan.types import Plan

from plan_space import enumerate_space
from plan_toys import block, chain, profile, random_profile


def _rounding_profile(rng: random.Random, num_blocks: int):
    """Sizes with no common divisor (slots round them), times all different."""
    blocks = [block(i, input_bytes=rng.randint(50, 130), saved_bytes=rng.randint(140, 400), bwd_temp_bytes=rng.randint(10, 90),
                    fwd_ms=float(rng.randint(1, 9)) + i / 7) for i in range(num_blocks)]
    return profile(blocks, fixed_post_saved_bytes=rng.randint(10, 70), param_bytes=30, grad_bytes=30)


@pytest.mark.parametrize("seed", range(6))
def test_coarse_slots_meet_the_ends_and_the_stated_bound(seed):
    """Slots of 12 to 64 bytes on sizes of 10 to 400: plans can be slower than the best that fits
    (``lost``), never slower than the best fitting the budget less the stated slack, and their
    bound is never above the best."""
    rng = random.Random(500 + seed)
    prof = _rounding_profile(rng, 4)
    space = enumerate_space(prof, options=False)
    none = plan(prof, strategy="none")
    baseline, keep_peak = none.prediction.step_ms, none.prediction.peak_bytes
    lost, bounded = 0, 0
    for slots in (24, 48, 96):
        search = OptimalSearch(prof, max_slots=slots)
        for budget in sorted(set(space.peaks.tolist())):
            choice = search.choose(budget)
            got = predict(prof, choice.segments)
            assert got.peak_bytes <= budget  # even at the least peak, which slots may round away
            slack = rounding_slack_bytes(prof.num_blocks, choice.optimality.quantum_bytes)
            assert got.step_ms <= space.best_ms(budget - slack) + 1e-9
            assert choice.optimality.lower_bound_ms <= space.best_ms(budget) - baseline + 1e-9
            assert choice.optimality.extra_ms == pytest.approx(got.step_ms - baseline)
            lost += got.step_ms > space.best_ms(budget) + 1e-9
            bounded += math.isfinite(space.best_ms(budget - slack))
        assert search.choose(keep_peak).segments == none.segments
    assert lost > 0 and bounded > 0  # the bound is tested where rounding costs time


def test_long_chain_meets_its_floor_and_keeps_everything_when_it_fits():
    """A chain longer than EXACT_MAX_BLOCKS with sizes the slot rounds: the least feasible peak
    and the no-recomputation peak are met exactly, and the plan says it counted slots."""
    num_blocks = EXACT_MAX_BLOCKS + 12
    blocks = [block(i, input_bytes=1_000_003, saved_bytes=7_000_001 + 13 * i, bwd_temp_bytes=500_009,
                    fwd_ms=1.0 + i / 100) for i in range(num_blocks)]
    prof = profile(blocks, fixed_post_saved_bytes=3_000_017, param_bytes=1_000, grad_bytes=1_000)
    search = OptimalSearch(prof)
    assert search.exact_solution() is None
    floor = predict(prof, search.min_peak_segments()).peak_bytes
    keep = plan(prof, strategy="none").prediction
    at_floor = plan(prof, budget=floor)
    assert at_floor.prediction.peak_bytes == floor
    assert at_floor.optimality.quantum_bytes > 1 and at_floor.optimality.lower_bound_ms <= at_floor.optimality.extra_ms
    assert plan(prof, budget=keep.peak_bytes).block_strategies() == ("keep",) * num_blocks
    with pytest.raises(ValueError, match="minimum feasible peak"):
        plan(prof, budget=floor - 1)


def test_optimality_travels_with_the_plan():
    prof = random_profile(random.Random(4), 4)
    space = enumerate_space(prof)
    budget = int(space.peaks[len(space.peaks) // 2])
    got = plan(prof, budget=budget)
    assert got.optimality.exact and got.optimality.quantum_bytes == 1
    assert Plan.from_json(got.to_json()) == got
    assert plan(prof, strategy="sqrt").optimality is None
    assert plan(prof).optimality is None  # no budget: nothing to be optimal against


def test_exact_tables_equal_slot_tables_when_slots_are_bytes():
    """Sizes in single bytes: the slot DP counts bytes too, and both curves agree point by point."""
    for seed in range(6):
        prof = random_profile(random.Random(700 + seed), 5)
        exact = OptimalSearch(prof).exact_solution()
        slots, quantum = OptimalSearch(prof, max_slots=10**6).slots.solve(10_000, to_keep_all=True)
        assert quantum == 1
        steps = [(m, cost) for m, cost in slots.curve() if m >= exact.curve()[0][0]]
        for m, cost in steps:
            assert exact.cost(m) == pytest.approx(cost)


def test_keep_need_is_the_no_recomputation_peak():
    """The search tells whether keeping everything fits without `predict`: the same bytes."""
    for seed in range(6):
        prof = random_profile(random.Random(900 + seed), 5)
        builder = OptimalSearch(prof).builder
        assert builder.fixed.peak_bytes(builder.keep_need()) == plan(prof, strategy="none").prediction.peak_bytes
