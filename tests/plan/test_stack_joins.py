"""Segments never cross a break in the chain: the joins mask, the planners, the check, the prices."""

from __future__ import annotations

import pytest

from plan_toys import block, profile, replace
from remat.plan.costs import cost_of, replay_working_bytes
from remat.plan.joins import break_reason, chain_runs, joins
from remat.plan.planners import make_plan, pareto, plan
from remat.plan.predict import predict
from remat.plan.search import OptimalSearch
from remat.plan.types import Segment


def _two_stacks():
    """Blocks 0-2 in stack "enc", 3-5 in "dec"; block 4 is called with other arguments than block 3."""
    blocks = []
    for i in range(6):
        b = block(i, input_bytes=4, saved_bytes=12 + i, fwd_ms=1.0 + i)
        blocks.append(replace(b, stack="enc" if i < 3 else "dec", follows_previous=i not in (0, 3, 4)))
    return profile(blocks, param_bytes=8, grad_bytes=8)


def test_joins_follow_the_stacks_and_the_calls():
    prof = _two_stacks()
    assert joins(prof) == (True, True, False, False, True)
    assert chain_runs(prof) == [(0, 3), (3, 4), (4, 6)]
    assert "different stacks ('enc', 'dec')" in break_reason(prof.blocks[2], prof.blocks[3])
    assert "does not call it with the previous block's output" in break_reason(prof.blocks[3], prof.blocks[4])


@pytest.mark.parametrize("field, value, reason", [
    ("between_saved_bytes", 8, "code between them saves 8 bytes for backward"),
    ("shared_entry_bytes", 4, "first to take a shared tensor of 4 bytes"),
])
def test_a_break_where_the_segment_would_not_hold_what_it_costs(field, value, reason):
    blocks = [replace(block(i, input_bytes=4, saved_bytes=12), stack="s", follows_previous=i > 0) for i in range(3)]
    blocks[1] = replace(blocks[1], **{field: value})
    assert break_reason(blocks[0], blocks[1]).endswith(reason)
    handing = replace(blocks[0], handoff_bytes=4, handoff_next_bytes=0)
    assert "held further on" in break_reason(handing, blocks[2])


@pytest.mark.parametrize("strategy, expected", [
    ("full", [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]),
    ("every:2", [(0, 2), (2, 3), (3, 4), (4, 6)]),
    ("every:5", [(0, 3), (3, 4), (4, 6)]),
    ("sqrt", [(0, 2), (2, 3), (3, 4), (4, 6)]),  # ceil(sqrt(3)) = 2, then runs of 1 and 2
])
def test_fixed_planners_cut_each_run_on_its_own(strategy, expected):
    segments = plan(_two_stacks(), strategy=strategy).segments
    assert [(s.start, s.stop) for s in segments] == expected
    assert all(s.strategy == "recompute" for s in segments)


def test_a_plan_crossing_a_break_is_refused_but_kept_blocks_may_span_it():
    prof = _two_stacks()
    crossing = (Segment(start=0, stop=6, strategy="recompute"),)
    with pytest.raises(ValueError, match=r"segment \[0, 6\) \(recompute\) runs blocks 2 and 3 \('blocks.2', "
                                         r"'blocks.3'\) as one chain, but they belong to different stacks"):
        predict(prof, crossing)
    nested = (Segment(start=3, stop=6, strategy="recompute", children=(Segment(start=3, stop=5, strategy="recompute"),)),)
    with pytest.raises(ValueError, match=r"Split the segment at block 4"):
        predict(prof, (Segment(start=0, stop=3, strategy="keep"), *nested))
    assert predict(prof, (Segment(start=0, stop=6, strategy="keep"),)).peak_bytes > 0


def test_the_optimal_search_never_crosses_a_break():
    prof = _two_stacks()
    frontier = pareto(prof)
    assert len(frontier) > 2
    for candidate in frontier:
        for seg in candidate.segments:
            assert all(joins(prof)[i] for i in range(seg.start, seg.stop - 1)), candidate.segments
    # without the mask the least-memory plan nests segments across the breaks: refused
    with pytest.raises(ValueError, match="runs blocks 2 and 3"):
        make_plan(prof, OptimalSearch(prof).min_peak_segments(), "optimal", None)
    least = frontier[-1].prediction.peak_bytes
    assert plan(prof, budget=least, strategy="optimal").prediction.peak_bytes == least


def test_dataflow_terms_enter_every_strategy():
    b = replace(block(1, input_bytes=10, saved_bytes=40, bwd_temp_bytes=5), held_input_bytes=6,
                unsaved_input_bytes=2, entry_bytes=7, handoff_bytes=3, fwd_temp_bytes=1, bwd_start_temp_bytes=4)
    prof = profile([replace(block(0, input_bytes=10, saved_bytes=40), handoff_bytes=3), b], param_bytes=0)
    keep = cost_of(prof, 1, Segment(start=1, stop=2, strategy="keep"))
    first = cost_of(prof, 1, Segment(start=1, stop=2, strategy="recompute"))
    inner = cost_of(prof, 1, Segment(start=0, stop=2, strategy="recompute"))
    assert keep.retained_bytes == 40 - 3 + 7  # saved, less handed off, plus entry
    assert keep.working_bytes == 40 + 5 + 7
    assert (first.retained_bytes, inner.retained_bytes) == (6 + 7, 0)
    # replay: saved + max(bwd temp 5, fwd temp 1 + start of backward 4 + inputs it saves 6 - 2) + entry + unsaved
    assert replay_working_bytes(b) == 40 + max(5, 1 + 4 + 4) + 7 + 2 == first.working_bytes
