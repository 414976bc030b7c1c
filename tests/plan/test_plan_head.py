"""The head as one more choice of the planner, on a profile small enough to price by hand.

Three blocks each keep 40 bytes (input 10), 2 ms forward and backward; the post part saves 60 bytes, 50 of them the head's
under keep, so the rest (a final norm) holds 10 through the head. The head (16 tokens, width 4,
vocabulary 8) measured: keep peaks at 140 in its backward, recompute the same 4 ms slower,
chunked:4 at 60 (+2 ms), chunked:2 at 40 (+5 ms); the rest of the post part's backward at 30.
"""

from __future__ import annotations

import dataclasses

import pytest

from plan_toys import block, profile
from remat.measure.types import HeadOption, HeadProfile, Profile
from remat.memory.head import projection_flops
from remat.plan.head import head_choices, head_extra_flops, head_extra_ms, head_need_bytes, priced_profile
from remat.plan.planners import make_plan, min_peak_plan, pareto, plan
from remat.plan.predict import predict
from remat.plan.types import Plan, Segment


def _option(strategy, saved, held, fwd, bwd, fwd_ms, bwd_ms):
    return HeadOption(strategy=strategy, saved_bytes=saved, held_bytes=held, fwd_peak_bytes=fwd, bwd_peak_bytes=bwd,
                      fwd_ms=fwd_ms, bwd_ms=bwd_ms)


HEAD = HeadProfile(
    projection="lm_head", kind="hf-causal-lm", labels_arg="labels", tied=False, num_tokens=16, hidden_size=4,
    vocab_size=8, dtype="float32", upcast=True, post_head_bytes=150, post_rest_bytes=30,
    options=(_option("keep", 50, 52, 100, 140, 1.0, 2.0), _option("recompute", 10, 12, 100, 140, 3.0, 4.0),
             _option("chunked:4", 12, 14, 30, 60, 2.0, 3.0), _option("chunked:2", 12, 14, 20, 40, 3.0, 5.0)),
)


def _profile(head: HeadProfile | None = HEAD) -> Profile:
    blocks = [block(i, input_bytes=10, saved_bytes=40, fwd_ms=2.0, bwd_ms=2.0) for i in range(3)]
    return profile(blocks, fixed_post_saved_bytes=60, fixed_post_bwd_temp_bytes=90, head=head)


def _keep(n: int = 3) -> tuple[Segment, ...]:
    return tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(n))


def test_post_part_need_by_head_strategy():
    prof = _profile()
    # max(rest + forward peak, measured head backward + the strategy's difference, the rest's backward)
    assert head_need_bytes(prof, "keep") == max(10 + 100, 150 + 0, 30) == 150
    assert head_need_bytes(prof, "chunked:4") == max(10 + 30, 150 + 60 - 140, 30) == 70
    assert head_need_bytes(prof, "chunked:2") == max(10 + 20, 150 + 40 - 140, 30) == 50
    assert head_extra_ms(prof, "chunked:4") == 2.0 and head_extra_ms(prof, "recompute") == 4.0
    assert head_extra_flops(prof, "chunked:2") == projection_flops(16, 4, 8) == 2 * 16 * 4 * 8
    assert head_extra_flops(prof, "keep") == 0
    # recompute holds less between forward and backward, but nothing runs then: keep dominates it
    assert head_choices(prof) == ("keep", "chunked:4", "chunked:2")
    assert head_choices(_profile(None)) == ("keep",)


def test_a_priced_profile_carries_the_head_in_its_post_part():
    priced = priced_profile(_profile(), "chunked:4")
    assert priced.head is None and "chunked:4" in priced.head_note
    assert priced.fixed_post_saved_bytes == 10 + 14  # the rest's saved bytes and what the head holds
    assert priced.fixed_post_saved_bytes + priced.fixed_post_bwd_temp_bytes == 70
    assert priced_profile(priced) == priced  # priced again with keep: unchanged
    with pytest.raises(ValueError, match=r"needs a head part, and this profile has none \(the post part is priced"):
        priced_profile(priced, "chunked:2")


def test_predict_prices_the_post_phase_by_the_head():
    prof = _profile()
    # no recomputation: the blocks retain 3 x 40 when the head's backward runs
    assert predict(prof, _keep(), "keep").peak_bytes == 120 + 150 == 270
    chunked = predict(prof, _keep(), "chunked:4")
    assert (chunked.peak_bytes, chunked.peak_phase, chunked.extra_ms) == (120 + 70, "post", 2.0)
    assert chunked.step_ms == 12.0 + 2.0  # three blocks of 2 + 2 ms, and the head's extra time
    assert chunked.extra_flops == projection_flops(16, 4, 8)
    assert predict(prof, _keep(), "chunked:2").peak_bytes == 170
    plan_ = make_plan(prof, _keep(), "none", None, head="chunked:2")
    assert plan_.head == "chunked:2" and predict(prof, plan_).peak_bytes == 170


def test_the_optimal_planner_chooses_the_head_too():
    prof = _profile()
    # 200: the chunked:4 head alone fits (190) and costs 2 ms; with the head kept, the blocks must
    # hold at most 50: block 0 kept (40), blocks 1-2 one segment (10), two forwards again (4 ms)
    at_200 = plan(prof, budget=200)
    assert (at_200.head, at_200.block_strategies(), at_200.prediction.peak_bytes) == ("chunked:4", ("keep",) * 3, 190)
    kept = plan(prof, budget=200, head="keep")
    assert kept.head == "keep" and kept.prediction.peak_bytes <= 200 and kept.prediction.extra_ms == 4.0
    # 175: chunked:4 with one block recomputed (10 + 80 + 70 = 160, 4 ms) beats chunked:2 (170, 5 ms)
    at_175 = plan(prof, budget=175)
    assert at_175.head == "chunked:4" and at_175.block_strategies().count("recompute") == 1
    assert at_175.prediction.extra_ms == 4.0
    with pytest.raises(ValueError, match=r"no plan fits the budget .* with keep, recompute, .* the head as keep or chunked:4 or chunked:2"):
        plan(prof, budget=55)  # the head's least need (50) above the least the blocks hold (10)
    assert plan(prof, strategy="full").head == "keep"
    assert plan(prof, strategy="full", head="chunked:2").head == "chunked:2"
    assert min_peak_plan(prof).head == "chunked:2"


def test_pareto_runs_through_the_head_strategies():
    frontier = pareto(_profile())
    heads = [p.head for p in frontier]
    assert heads[0] == "keep" and "chunked:4" in heads and heads[-1] == "chunked:2"
    peaks = [p.prediction.peak_bytes for p in frontier]
    times = [p.prediction.step_ms for p in frontier]
    assert peaks == sorted(peaks, reverse=True) and times == sorted(times)


def test_head_errors_name_the_choices():
    prof = _profile()
    with pytest.raises(ValueError, match=r"head strategy 'chunked:3' was not measured; measured: keep, recompute, chunked:4, chunked:2"):
        plan(prof, head="chunked:3")
    with pytest.raises(ValueError, match=r"unknown head strategy 'fused'; allowed: keep, recompute, chunked:<tokens>"):
        plan(prof, head="fused")
    with pytest.raises(ValueError, match=r"head strategy 'chunked:0' needs a positive number of tokens per chunk"):
        plan(prof, head="chunked:0")
    with pytest.raises(ValueError, match=r"head strategy 'keep:1' takes no argument"):
        plan(prof, head="keep:1")


def test_plans_and_profiles_keep_their_head_through_json(tmp_path):
    prof = _profile()
    assert Profile.from_json(prof.to_json()) == prof
    chosen = plan(prof, budget=200)
    assert Plan.from_json(chosen.to_json()) == chosen
    # a plan written before plans had a head keeps the head
    text = chosen.to_json().replace(',\n  "head": "chunked:4"', "")
    assert '"head"' not in text and Plan.from_json(text).head == "keep"
    with pytest.raises(ValueError, match="unknown head strategy 'fused'"):
        Plan.from_json(chosen.to_json().replace('"head": "chunked:4"', '"head": "fused"'))
    assert dataclasses.replace(chosen, head="recompute").head == "recompute"
