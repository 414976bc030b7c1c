"""The chain DP's fast paths against its exact tables and against exhaustive enumeration.

Slots here are the DP's own units (`remat.plan.chain_dp.ChainProblem`); the profile-level tests
go through `remat.plan.search.OptimalSearch` and compare with every plan of the space.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from remat.plan.chain_dp import BlockOption, ChainBlock, ChainProblem, Element, _shift, _shift_row, solve_chain
from remat.plan.predict import predict
from remat.plan.options import undominated_rows
from remat.plan.search import OptimalSearch
from remat.plan.types import Segment

from plan_toys import block, profile, random_profile
from test_optimal import _best, _space

EXACT = 10**12
"""``exact_cells`` that always selects the exact O(N^3 M) tables."""


def _chain(fwd_ms: list[float], *, input_slots=1, saved_slots=3, working_slots=2, capacity=12, grad_slots=0,
           stop_working_slots=None, stop_saving_ms: list[float] | None = None):
    keep = BlockOption(label=0, retained_slots=saved_slots, working_slots=working_slots, extra_ms=0.0)
    savings = stop_saving_ms or [0.0] * len(fwd_ms)
    blocks = tuple(ChainBlock(input_slots=input_slots, saved_slots=saved_slots, working_slots=working_slots,
                              fwd_ms=t, options=(keep,), grad_slots=grad_slots, stop_working_slots=stop_working_slots,
                              stop_saving_ms=saving) for t, saving in zip(fwd_ms, savings))
    return ChainProblem(blocks=blocks, post_slots=1, capacity_slots=capacity)


def _columns(solution):
    return [m for m, cost in solution.curve() if math.isfinite(cost)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stops", [False, True])
def test_shared_tables_bound_the_exact_tables(seed, stops):
    """Blocks alike in slots, forward times differing: the shared tables' cost is a lower bound
    of the exact least, and the shared layout priced with the real times (cost + gap) an upper;
    ``stops``: each region's last block replays a share of its forward (it stops early) and works
    with a slot less."""
    rng = random.Random(seed)
    fwd = [float(rng.randint(1, 9)) for _ in range(rng.randint(3, 7))]
    savings = [t * rng.randint(0, 4) / 8 for t in fwd] if stops else None
    problem = _chain(fwd, capacity=rng.randint(6, 20), stop_working_slots=1 if stops else None, stop_saving_ms=savings)
    shared, exact = solve_chain(problem, exact_cells=0), solve_chain(problem, exact_cells=EXACT)
    assert not shared.exact and exact.exact
    for m in _columns(exact):
        least = exact.cost(m)
        assert exact.layout_ms(exact.layout(m)) == pytest.approx(least)
        assert shared.cost(m) <= least + 1e-9
        assert shared.cost(m) + shared.gap_ms(m) == pytest.approx(shared.layout_ms(shared.layout(m)))
        assert shared.layout_ms(shared.layout(m)) >= least - 1e-9


@pytest.mark.parametrize("grad_slots", [0, 1])
@pytest.mark.parametrize("stops", [False, True])
def test_shared_tables_are_exact_for_equal_times(grad_slots, stops):
    problem = _chain([2.5] * 7, capacity=9, grad_slots=grad_slots, stop_working_slots=1 if stops else None,
                     stop_saving_ms=[1.5] * 7 if stops else None)
    shared, exact = solve_chain(problem, exact_cells=0), solve_chain(problem, exact_cells=EXACT)
    assert shared.exact
    costs = torch.tensor([shared.cost(m) for m in _columns(exact)])
    torch.testing.assert_close(costs, torch.tensor([exact.cost(m) for m in _columns(exact)]))
    assert all(shared.gap_ms(m) == 0.0 for m in _columns(exact))


def _lengths(elements: tuple[Element, ...]):
    for e in elements:
        if e.option is None:
            yield e.stop - e.start
            yield from _lengths(e.children)


@pytest.mark.parametrize("exact_cells", [0, EXACT])
def test_segment_limit_bounds_every_segment(exact_cells):
    """With segments of at most 2 blocks: no longer segment at any depth, never cheaper than
    the unlimited DP, and the same as it when the limit is the chain's length."""
    problem = _chain([1.0, 2.0, 3.0, 1.0, 2.0, 1.0, 4.0, 1.0], capacity=10)
    free = solve_chain(problem, exact_cells=exact_cells)
    limited = solve_chain(ChainProblem(blocks=problem.blocks, post_slots=1, capacity_slots=10, max_segment_blocks=2),
                          exact_cells=exact_cells)
    whole = solve_chain(ChainProblem(blocks=problem.blocks, post_slots=1, capacity_slots=10, max_segment_blocks=8),
                        exact_cells=exact_cells)
    for m in _columns(limited):
        assert max(_lengths(limited.layout(m)), default=0) <= 2
        assert limited.cost(m) >= free.cost(m) - 1e-9
    assert [whole.cost(m) for m in _columns(free)] == [free.cost(m) for m in _columns(free)]
    assert min(_columns(free)) < min(_columns(limited))  # the least memory needs long nested segments


def test_shift_row_matches_shift():
    rng = np.random.default_rng(0)
    row = rng.random(7)
    shifts = np.array([-9, -7, -3, 0, 2, 6, 7, 12])
    expected = _shift(np.broadcast_to(row, (shifts.size, row.size)), shifts)
    np.testing.assert_array_equal(_shift_row(row, shifts), expected)


def test_undominated_matches_filtering_in_order():
    """Rows share the bytes and differ in times; each row's mask equals filtering it in order."""
    rng = random.Random(3)
    retained = np.array([rng.randint(0, 3) for _ in range(60)])
    working = np.array([rng.randint(0, 3) for _ in range(60)])
    ms = np.array([[float(rng.randint(0, 3)) for _ in range(60)] for _ in range(5)])
    mask = undominated_rows(retained, working, ms)
    for row in range(5):
        keys = list(zip(retained.tolist(), working.tolist(), ms[row].tolist()))
        kept: list[tuple] = []
        for k in keys:
            if not any(all(q[i] <= k[i] for i in range(3)) for q in kept):
                kept.append(k)
        assert [k for k, ok in zip(keys, mask[row]) if ok] == kept
    assert undominated_rows(np.zeros(0), np.zeros(0), np.zeros((2, 0))).shape == (2, 0)


def _budgets(space):
    peaks = [peak for peak, _ in space]
    return sorted({peaks[0], peaks[len(peaks) // 2], peaks[-1]})


@pytest.mark.parametrize("seed", range(8))
def test_optimality_is_exact_when_slots_are(seed):
    """Small integer sizes: the slot is their gcd, the bound meets the plan and the plan meets
    exhaustive enumeration."""
    torch.manual_seed(seed)
    prof = random_profile(random.Random(seed), 4)
    baseline = predict(prof, tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(4))).step_ms
    space = _space(prof)
    for budget in _budgets(space):
        result = OptimalSearch(prof).optimality(budget)
        assert result.exact and result.gap_ms == 0.0
        assert result.extra_ms == pytest.approx(_best(space, budget) - baseline)


@pytest.mark.parametrize("seed", range(6))
def test_optimality_brackets_the_optimum_when_slots_round(seed):
    """Sizes with no common divisor and 3 slots: the plan may be slower than the best, and the
    bound is never above the best of every plan that fits (exhaustive enumeration). Every
    budget at or above the least peak gets a plan, however coarse the slots."""
    rng = random.Random(50 + seed)
    blocks = [block(i, input_bytes=rng.randint(5, 13), saved_bytes=rng.randint(14, 40), bwd_temp_bytes=rng.randint(1, 9),
                    fwd_ms=float(rng.randint(1, 9))) for i in range(4)]
    prof = profile(blocks, fixed_post_saved_bytes=rng.randint(1, 7))
    keep = tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(4))
    baseline, space = predict(prof, keep).step_ms, _space(prof)
    for budget in _budgets(space):
        search = OptimalSearch(prof, max_slots=3)
        segments = search.best_segments(budget)
        assert predict(prof, segments).peak_bytes <= budget
        result = search.optimality(budget)
        best = _best(space, budget) - baseline
        assert result.lower_bound_ms <= best + 1e-9 <= result.extra_ms + 2e-9
        assert result.extra_ms == pytest.approx(predict(prof, segments).step_ms - baseline)
        assert result.gap_ms == pytest.approx(result.extra_ms - result.lower_bound_ms)


def test_optimality_rejects_a_budget_nothing_fits():
    prof = random_profile(random.Random(1), 3)
    with pytest.raises(ValueError, match="no plan fits the budget of 0 bytes"):
        OptimalSearch(prof).optimality(0)


def test_last_kept_block_of_a_replay_may_leave_less_than_any_need():
    """Block 0: 10 saved bytes, 5 forward temporaries, 2 gradient bytes. The plan
    recompute[0,3){recompute[0,2)} keep[3,4) keeps block 1 last in its replay, leaving fewer
    free bytes than any block needs, with nothing left to run: it fits 33 bytes at +32 ms
    (exhaustive enumeration), and the DP finds it."""
    prof = random_profile(random.Random(3), 4)
    keep = tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(4))
    baseline, space = predict(prof, keep).step_ms, _space(prof)
    assert _best(space, 33) - baseline == 32.0
    result = OptimalSearch(prof).optimality(33)
    assert result.exact and result.extra_ms == 32.0


def _all_segments(elements):
    for e in elements:
        if e.option is None:
            yield e
            yield from _all_segments(e.children)


@pytest.mark.parametrize("exact_cells", [0, EXACT])
def test_joins_keep_blocks_apart_at_every_depth(exact_cells):
    """Blocks 2 and 3 may not share a segment: no layout of the tables holds both in one, at any
    depth; all joins allowed is the unmasked DP; none allowed leaves one-block segments."""
    fwd = [1.0, 2.0, 3.0, 1.0, 2.0, 1.0]
    free = solve_chain(_chain(fwd, capacity=9), exact_cells=exact_cells)
    masked = solve_chain(ChainProblem(blocks=free.problem.blocks, post_slots=1, capacity_slots=9,
                                      joins=(True, True, False, True, True)), exact_cells=exact_cells)
    every = solve_chain(ChainProblem(blocks=free.problem.blocks, post_slots=1, capacity_slots=9,
                                     joins=(True,) * 5), exact_cells=exact_cells)
    alone = solve_chain(ChainProblem(blocks=free.problem.blocks, post_slots=1, capacity_slots=9,
                                     joins=(False,) * 5), exact_cells=exact_cells)
    assert every.curve() == free.curve()
    for m in _columns(masked):
        assert all(not (e.start <= 2 and e.stop >= 4) for e in _all_segments(masked.layout(m)))
        assert masked.cost(m) >= free.cost(m)
    for m in _columns(alone):
        assert all(e.stop - e.start == 1 for e in _all_segments(alone.layout(m)))
    assert min(_columns(masked)) > min(_columns(free))  # the least memory needs a segment over 2 and 3
