"""predict() on a hand-made 3-block profile; every number below is worked out in comments.

Blocks (input, saved, backward temporaries; fwd ms; fwd FLOPs):
  b0: 4, 10, 2; 1 ms; 100     working = 12
  b1: 3,  8, 1; 2 ms; 200     working = 9
  b2: 5, 12, 3; 3 ms; 300     working = 15
Model state during backward: params 100 + buffers 10 + optimizer state 200 = 310, fixed pre
saved 7; gradients (100, no per-block split) count from the first block's backward on, none at
the head's backward (its own are among its temporaries). So a block's backward starts from
417, the head's from 317; the head needs post saved 6 + temporaries 4 = 10.
Optimizer step: model state 410 + step temporaries 20 = 430.
Baseline step: fixed 1 + 2, blocks (1+2) + (2+2) + (3+2) = 12, optimizer 0.5 -> 15.5 ms.
"""

import pytest

from remat.plan import costs
from remat.plan.costs import BlockCost
from remat.plan.predict import predict
from remat.plan.types import Plan, Segment

from plan_toys import block, op, profile, replace

B1_OPS = (
    op("aten.mm.default#0", 5, 5, 0.5, 50),
    op("aten.relu.default#0", 5, 3, 0.25, 5),
    op("aten.view.default#0", 0, 0, 0.125, is_view=True),
    op("aten.mm.default#1", 4, 0, 1.0, 70),
)


def toy3(**fields):
    blocks = [
        block(0, input_bytes=4, saved_bytes=10, bwd_temp_bytes=2, fwd_ms=1.0, fwd_flops=100),
        block(1, input_bytes=3, saved_bytes=8, bwd_temp_bytes=1, fwd_ms=2.0, fwd_flops=200, ops=B1_OPS),
        block(2, input_bytes=5, saved_bytes=12, bwd_temp_bytes=3, fwd_ms=3.0, fwd_flops=300),
    ]
    base = dict(
        param_bytes=100, grad_bytes=100, optimizer_state_bytes=200, buffer_bytes=10, optimizer_name="AdamW",
        optimizer_step_temp_bytes=20, optimizer_step_ms=0.5, fixed_pre_saved_bytes=7, fixed_post_saved_bytes=6,
        fixed_post_bwd_temp_bytes=4, fixed_fwd_ms=1.0, fixed_bwd_ms=2.0,
    )
    base.update(fields)
    return profile(blocks, **base)


def seg(start, stop, strategy="keep", **kw):
    return Segment(start=start, stop=stop, strategy=strategy, **kw)


def test_keep_everything():
    # retained (10, 8, 12); backward of b2: 417 + 18 + 15 = 450; head: 317 + 30 + 10 = 357.
    pred = predict(toy3(), [seg(0, 1), seg(1, 2), seg(2, 3)])
    assert pred.retained_bytes == (10, 8, 12)
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (450, "block", 2, 15)
    assert pred.fixed_bytes == 7
    head = predict(toy3(fixed_post_bwd_temp_bytes=200), [seg(0, 3)])  # head: 317 + 30 + 206 = 553
    assert (head.peak_bytes, head.peak_phase, head.peak_block, head.fixed_bytes) == (553, "post", -1, 13)
    assert pred.model_state_bytes == 410
    assert (pred.step_ms, pred.extra_ms, pred.extra_flops) == (15.5, 0.0, 0)


def test_keep_as_one_segment_equals_per_block():
    assert predict(toy3(), [seg(0, 3)]) == predict(toy3(), [seg(0, 1), seg(1, 2), seg(2, 3)])


def test_recompute_every_block():
    # retained (4, 3, 5); b2: 417 + 7 + 15 = 439; head: 317 + 12 + 10 = 339.
    pred = predict(toy3(), [seg(0, 1, "recompute"), seg(1, 2, "recompute"), seg(2, 3, "recompute")])
    assert pred.retained_bytes == (4, 3, 5)
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (439, "block", 2, 15)
    assert (pred.extra_ms, pred.extra_flops, pred.step_ms) == (6.0, 600, 21.5)


def test_recompute_segment_keeps_blocks_during_replay():
    # [0,3) recompute, no children: replay keeps b0, b1: b2's backward: 417 + 10 + 8 + 15 = 450.
    pred = predict(toy3(), [seg(0, 3, "recompute")])
    assert pred.retained_bytes == (4, 0, 0)
    assert (pred.peak_bytes, pred.peak_block, pred.working_bytes) == (450, 2, 15)
    assert pred.extra_ms == 6.0


def test_a_replay_holds_its_first_blocks_unsaved_input_to_its_end():
    # b0 does not save its input (4 bytes, held by the checkpoint; its input needs no gradient):
    # replayed it works with 10 + 2 + 4 = 16. [0,3) recompute: the checkpoint holds the 4 bytes
    # until b0's backward, after the others': b1: 417 + 10 + 4 + 9 = 440, b2: 417 + 14 + 8 + 15
    # = 454. Counted with b0's saved bytes alone, b2 came out at 450, the measured peak 4 above.
    prof = toy3()
    prof = replace(prof, blocks=(replace(prof.blocks[0], held_input_bytes=4, unsaved_input_bytes=4),) + prof.blocks[1:])
    pred = predict(prof, [seg(0, 3, "recompute")])
    assert (pred.peak_bytes, pred.peak_block, pred.working_bytes) == (454, 2, 15)
    # a child [0,2) holds it through b1's backward (440); then [0,3)'s checkpoint, as retained
    # bytes: b2: 417 + 4 + 15 = 436
    pred = predict(prof, [seg(0, 3, "recompute", children=(seg(0, 2, "recompute"),))])
    assert (pred.peak_bytes, pred.peak_block) == (440, 1)
    # a segment starting at b1 holds b1's input, not b0's: b2: 417 + 4 + 8 + 15 = 444
    assert predict(prof, [seg(0, 1, "recompute"), seg(1, 3, "recompute")]).peak_bytes == 444
    # a block kept after another in the same replay: its input comes from the replay, and what
    # it does not save of it is gone after its forward: b2 at 450 as without it
    prof = toy3()
    prof = replace(prof, blocks=(prof.blocks[0], replace(prof.blocks[1], held_input_bytes=3, unsaved_input_bytes=3), prof.blocks[2]))
    assert predict(prof, [seg(0, 3, "recompute")]).peak_bytes == 450


def test_the_optimal_search_counts_a_replays_unsaved_input():
    """The DP's replay tables count a kept block's unsaved input where it starts a segment's
    replay: its plans never exceed the budget predict prices, at every point of the frontier
    and at every layout's own peak."""
    from remat.plan.planners import pareto, plan

    prof = toy3()
    prof = replace(prof, blocks=(replace(prof.blocks[0], held_input_bytes=4, unsaved_input_bytes=4),) + prof.blocks[1:])
    budgets = {p.prediction.peak_bytes for p in pareto(prof)} | {454, 453, 444, 440}
    for budget in sorted(budgets):
        try:
            got = plan(prof, budget=budget)
        except ValueError:
            assert budget < min(p.prediction.peak_bytes for p in pareto(prof))
            continue
        assert got.prediction.peak_bytes <= budget, (budget, got.segments)


def test_nested_recompute():
    # [0,3) recompute with child [0,2) recompute with child [0,1) recompute.
    # innermost [0,1): b0 working 12. [0,2): max(12, 4 + 9 = 13). [0,3): max(13, 4 + 15 = 19).
    # block phase 417 + 19 = 436 at b2; head 317 + 4 + 10 = 331.
    # extra: replays of [0,3) 6 ms + [0,2) 3 ms + [0,1) 1 ms = 10 ms; FLOPs 600 + 300 + 100.
    inner = seg(0, 2, "recompute", children=(seg(0, 1, "recompute"),))
    pred = predict(toy3(), [seg(0, 3, "recompute", children=(inner,))])
    assert pred.retained_bytes == (4, 0, 0)
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (436, "block", 2, 15)
    assert (pred.extra_ms, pred.extra_flops, pred.step_ms) == (10.0, 1000, 25.5)


def test_nested_peak_inside_child():
    # Make b0's backward heavy (temp 40 -> working 50): [0,2) child replay: 50 at b0.
    prof = toy3()
    prof = replace(prof, blocks=(replace(prof.blocks[0], bwd_temp_bytes=40),) + prof.blocks[1:])
    inner = seg(0, 2, "recompute", children=(seg(0, 1, "recompute"),))
    pred = predict(prof, [seg(0, 3, "recompute", children=(inner,))])
    assert (pred.peak_bytes, pred.peak_block, pred.working_bytes) == (417 + 50, 0, 50)


def test_selective_saves_named_ops():
    # b1 selective saving mm#0: retained input 3 + output 5 = 8; replays relu 0.25 + mm#1 1.0
    # (the view costs nothing); FLOPs 5 + 70. Plan keep b0, selective b1, recompute b2:
    # retained (10, 8, 5): b2: 417 + 18 + 15 = 450; head 317 + 23 + 10 = 350.
    segments = [seg(0, 1), seg(1, 2, "selective:save-matmuls", saved_ops=("aten.mm.default#0",)), seg(2, 3, "recompute")]
    pred = predict(toy3(), segments)
    assert pred.retained_bytes == (10, 8, 5)
    assert (pred.peak_bytes, pred.peak_block) == (450, 2)
    assert pred.extra_ms == pytest.approx(4.25)
    assert pred.extra_flops == 75 + 300


def test_selective_counts_each_op_once():
    segments = [seg(0, 1), seg(1, 2, "selective:x", saved_ops=("aten.mm.default#0", "aten.mm.default#0")), seg(2, 3)]
    assert predict(toy3(), segments).retained_bytes == (10, 8, 12)


def test_selective_unknown_op_is_an_error():
    with pytest.raises(ValueError, match=r"has no op call\(s\) \['aten.bmm.default#0'\]"):
        predict(toy3(), [seg(0, 1), seg(1, 2, "selective:x", saved_ops=("aten.bmm.default#0",)), seg(2, 3)])


def test_optimizer_phase_can_set_the_peak():
    pred = predict(toy3(optimizer_step_temp_bytes=100), [seg(0, 3, "recompute")])
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.fixed_bytes) == (510, "optimizer", -1, 0)


def test_offload_cpu_on_cpu_profile_is_an_error():
    with pytest.raises(ValueError, match="already in host memory.*offload:disk"):
        predict(toy3(), [seg(0, 1, "offload:cpu"), seg(1, 3)])


def test_offload_uses_the_registered_cost(monkeypatch):
    def fake(profile, index, segment):
        b = profile.blocks[index]
        return BlockCost(retained_bytes=1, working_bytes=b.saved_bytes + b.bwd_temp_bytes, extra_ms=0.5,
                         extra_flops=0, offloaded_bytes=b.saved_bytes - 1)

    monkeypatch.setitem(costs._REGISTRY, "offload", fake)
    prof = toy3(fingerprint=replace(toy3().fingerprint, device="cuda"))
    pred = predict(prof, [seg(0, 1, "offload:cpu"), seg(1, 3)])
    # retained (1, 8, 12): b2: 417 + 9 + 15 = 441; head: 317 + 21 + 10 = 348.
    assert pred.retained_bytes == (1, 8, 12)
    assert (pred.peak_bytes, pred.peak_phase, pred.offloaded_bytes, pred.extra_ms) == (441, "block", 9, 0.5)


def test_segments_must_cover_blocks():
    with pytest.raises(ValueError, match="starts at 2, expected 1"):
        predict(toy3(), [seg(0, 1), seg(2, 3)])
    with pytest.raises(ValueError, match="cover 2 blocks but the profile has 3"):
        predict(toy3(), [seg(0, 2)])
    with pytest.raises(ValueError, match="overlap"):
        predict(toy3(), [seg(0, 3, "recompute", children=(seg(0, 2, "recompute"), seg(1, 3, "recompute")))])


def test_accepts_a_plan():
    prof = toy3()
    segments = (seg(0, 3, "recompute"),)
    pred = predict(prof, segments)
    plan = Plan(segments=segments, block_names=("blocks.0", "blocks.1", "blocks.2"), strategy_name="full",
                budget_bytes=None, prediction=pred, fingerprint=prof.fingerprint)
    assert predict(prof, plan) == pred
    assert Plan.from_json(plan.to_json()) == plan


def test_gradients_accumulate_during_backward():
    # Block gradients 20, 30, 40 of the 100: when b2's backward starts only the head's 10 are
    # accumulated (fixed part's, not split: 100 - 90), at b1: 10 + 40, at b0: 10 + 40 + 30.
    # Keep all, base 310 + pre 7 = 317: b2: 317 + 10 + 18 + 15 = 360; b1: 317 + 50 + 10 + 9 = 386;
    # b0: 317 + 80 + 12 = 409; head: 317 + 30 + 10 = 357; optimizer 410 + 20.
    prof = toy3()
    grads = (20, 30, 40)
    prof = replace(prof, blocks=tuple(replace(b, grad_bytes=g) for b, g in zip(prof.blocks, grads)))
    pred = predict(prof, [seg(0, 1), seg(1, 2), seg(2, 3)])
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (430, "optimizer", -1, 0)
    prof = replace(prof, optimizer_step_temp_bytes=0)
    pred = predict(prof, [seg(0, 1), seg(1, 2), seg(2, 3)])
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (410, "optimizer", -1, 0)
    prof = replace(prof, fixed_pre_saved_bytes=30)  # b0: 340 + 80 + 12 = 432 > head 380, optimizer 410
    pred = predict(prof, [seg(0, 1), seg(1, 2), seg(2, 3)])
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block, pred.working_bytes) == (432, "block", 0, 12)


def test_replayed_forward_temporaries():
    # b1 forward temporaries 20 (> its backward temporaries 1): wherever b1's forward is replayed
    # in backward it works with 8 + 20 = 28 instead of 9. Full recompute: b1: 417 + 4 + 28 = 449.
    prof = toy3()
    prof = replace(prof, blocks=(prof.blocks[0], replace(prof.blocks[1], fwd_temp_bytes=20), prof.blocks[2]))
    pred = predict(prof, [seg(0, 1, "recompute"), seg(1, 2, "recompute"), seg(2, 3, "recompute")])
    assert (pred.peak_bytes, pred.peak_block, pred.working_bytes) == (449, 1, 28)
    # kept at the top level its forward is not replayed: b2's 450 is the peak again.
    assert predict(prof, [seg(0, 3)]).peak_bytes == 450
    # kept inside the replay of [0, 3): 417 + 10 + 28 = 455.
    assert (predict(prof, [seg(0, 3, "recompute")]).peak_bytes, predict(prof, [seg(0, 3, "recompute")]).peak_block) == (455, 1)


def test_pre_part_gradients_arrive_last():
    # 30 of the 100 gradient bytes belong to the embedding (pre part): not live in blocks'
    # backward. Keep all: b2: 310 + 70 + 7 + 18 + 15 = 420; optimizer 430 sets the peak.
    pred = predict(toy3(fixed_pre_grad_bytes=30), [seg(0, 3)])
    assert (pred.peak_bytes, pred.peak_phase) == (430, "optimizer")
    pred = predict(toy3(fixed_pre_grad_bytes=30, optimizer_step_temp_bytes=0), [seg(0, 3)])
    assert (pred.peak_bytes, pred.peak_phase, pred.peak_block) == (420, "block", 2)


def test_fresh_memory_a_lower_peak_does_not_fault_in():
    # The baseline faults in 8 bytes at 0.25 ms each. Keep: peak 450, nothing saved, 15.5 ms.
    # Recompute every block: peak 439, 11 lower, so all 8 bytes avoided: 21.5 - 2.0 = 19.5 ms.
    # Recompute b0 only: retained (4, 8, 12), b2's backward 417 + 12 + 15 = 444: 6 bytes avoided,
    # 2 still faulted; 15.5 + 1.0 - 1.5 = 15.0 ms, faster than keeping everything.
    prof = toy3(step_fault_bytes=8, first_touch_ms_per_byte=0.25)
    keep = predict(prof, [seg(0, 3)])
    assert (keep.peak_bytes, keep.fault_bytes, keep.fault_saving_ms, keep.step_ms) == (450, 8, 0.0, 15.5)
    full = predict(prof, [seg(0, 1, "recompute"), seg(1, 2, "recompute"), seg(2, 3, "recompute")])
    assert (full.peak_bytes, full.fault_bytes, full.fault_saving_ms, full.step_ms) == (439, 0, 2.0, 19.5)
    first = predict(prof, [seg(0, 1, "recompute"), seg(1, 3)])
    assert (first.peak_bytes, first.fault_bytes, first.fault_saving_ms, first.step_ms) == (444, 2, 1.5, 15.0)
    # without a measured fault cost the term is absent
    assert predict(toy3(step_fault_bytes=8), [seg(0, 1, "recompute"), seg(1, 3)]).step_ms == 16.5


def test_optimal_takes_a_lower_peak_when_it_pays_for_its_replay():
    """With room for everything, recomputing b0 (+1 ms, 6 bytes less faulted: -1.5 ms) is the
    fastest plan (see the test above: every other layout is slower: b1 alone +0.75 ms, b0 and b1
    +1.0 ms); without the fault cost, keeping everything is."""
    from remat.plan.planners import plan

    got = plan(toy3(step_fault_bytes=8, first_touch_ms_per_byte=0.25), budget=450)
    assert got.prediction.step_ms == 15.0
    assert [(s.start, s.stop, s.strategy) for s in got.segments] == [(0, 1, "recompute"), (1, 2, "keep"), (2, 3, "keep")]
    assert plan(toy3(), budget=450).prediction.step_ms == 15.5
