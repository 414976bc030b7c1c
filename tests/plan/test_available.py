"""Strategies a block cannot run (its probe raised in the profile): no planner picks them."""

from __future__ import annotations

import math
import random

import pytest

from remat.plan.available import check_available, fall_back, unavailable_blocks
from remat.plan.planners import make_plan, plan
from remat.plan.predict import predict
from remat.plan.search import block_options
from remat.plan.types import Segment

from plan_toys import chain, random_profile, replace
from test_optimal import _tops, _with_ops

NO_REPLAY = (("recompute", "CheckpointError: a different number of tensors was saved"),)
NO_SELECTIVE = (("selective", "RuntimeError: Tensor cached during selective activation checkpoint has been mutated"),)


def _marked(prof, marks):
    """``prof`` with ``marks[i]`` as block i's unavailable strategies."""
    blocks = tuple(replace(b, unavailable=marks.get(b.index, ())) for b in prof.blocks)
    return replace(prof, blocks=blocks)


def test_the_reason_is_found_by_strategy_and_kind():
    block = _marked(chain(1, input_bytes=1, saved_bytes=2), {0: NO_SELECTIVE + (("offload:disk", "OSError: x"),)}).blocks[0]
    assert block.unavailable_reason("selective:knapsack") == NO_SELECTIVE[0][1]
    assert block.unavailable_reason("offload:disk") == "OSError: x"
    assert block.unavailable_reason("offload:cpu") is None and block.unavailable_reason("recompute") is None
    assert block.unavailable_reason("keep") is None


def test_fixed_planners_give_the_block_the_nearest_strategy_it_can_run():
    prof = _marked(chain(5, input_bytes=1, saved_bytes=10), {2: NO_REPLAY})
    assert plan(prof, strategy="full").block_strategies() == ("recompute", "recompute", "keep", "recompute", "recompute")
    spans = [(s.start, s.stop, s.strategy) for s in plan(prof, strategy="every:5").segments]
    assert spans == [(0, 2, "recompute"), (2, 3, "keep"), (3, 5, "recompute")]
    both = _marked(chain(3, input_bytes=1, saved_bytes=10), {1: NO_SELECTIVE, 2: NO_SELECTIVE + NO_REPLAY})
    assert fall_back(both, [Segment(start=i, stop=i + 1, strategy="selective:x") for i in range(3)]) == (
        Segment(start=0, stop=1, strategy="selective:x"), Segment(start=1, stop=2, strategy="recompute"),
        Segment(start=2, stop=3, strategy="keep"))


def test_a_plan_naming_an_unavailable_strategy_is_refused_with_the_reason():
    prof = _marked(chain(3, input_bytes=1, saved_bytes=10), {1: NO_REPLAY})
    nested = Segment(start=0, stop=3, strategy="recompute",
                     children=(Segment(start=1, stop=2, strategy="recompute"),))
    assert unavailable_blocks(prof, nested) == [(1, NO_REPLAY[0][1]), (1, NO_REPLAY[0][1])]
    with pytest.raises(ValueError, match=r"block 'blocks.1' cannot run 'recompute': its probe raised "
                                         r"CheckpointError: a different number .* Plan another strategy"):
        make_plan(prof, (nested,), "by hand", None)
    check_available(prof, (Segment(start=0, stop=1, strategy="recompute"), Segment(start=1, stop=2, strategy="keep"),
                           Segment(start=2, stop=3, strategy="recompute")))


def test_no_selective_option_is_offered_where_the_probe_failed():
    rng = random.Random(0)
    prof = _with_ops(random_profile(rng, 3), rng)
    assert any(s.kind == "selective" for s in block_options(prof, 0))
    marked = _marked(prof, {0: NO_SELECTIVE})
    assert [s.strategy for s in block_options(marked, 0)] == ["keep"]


def _allowed_space(prof):
    """(peak, least step ms) over every plan whose strategies each block can run."""
    points = {}
    for segments in _tops(prof, 0):
        if any(unavailable_blocks(prof, s) for s in segments):
            continue
        pred = predict(prof, segments)
        points[pred.peak_bytes] = min(points.get(pred.peak_bytes, math.inf), pred.step_ms)
    return sorted(points.items())


@pytest.mark.parametrize("seed", range(8))
def test_optimal_equals_the_enumeration_of_the_plans_blocks_can_run(seed):
    """A random block cannot be replayed, another cannot run selectively: the optimal planner's
    step time at each budget is the least over the plans that avoid both, and its plan avoids them."""
    rng = random.Random(100 + seed)
    prof = _with_ops(random_profile(rng, rng.randint(3, 4)), rng)
    no_replay, no_selective = rng.sample(range(prof.num_blocks), 2)
    prof = _marked(prof, {no_replay: NO_REPLAY, no_selective: NO_SELECTIVE})
    space = _allowed_space(prof)
    low, high = space[0][0], space[-1][0]
    for budget in sorted({low, *(low + k * (high - low) // 4 for k in range(5))}):
        got = plan(prof, budget=budget)
        assert all(not unavailable_blocks(prof, s) for s in got.segments)
        assert got.prediction.step_ms == pytest.approx(min(ms for peak, ms in space if peak <= budget))
    least = plan(prof, budget=low)
    assert least.prediction.peak_bytes == low
