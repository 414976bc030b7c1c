"""Early-stopping replays on a toy block whose last saved tensor comes before its last ops: where
the profile says the replay stops, the op calls the runtime replays, the bytes and FLOPs the
planner prices, and the peak `verify` measures against the prediction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apply_helpers import assert_identical, block_op_counts, make_plan, seg, train
from remat.apply.api import apply_
from remat.apply.opcount import BlockOpCounter, expected_extra_calls
from remat.measure.profile import profile
from remat.plan.phases import (replay_base_bytes, replay_stop, replay_working_bytes, saved_input_bytes,
                               stopped_replay_flops, stopped_replay_ms, stopped_replay_working_bytes)
from remat.plan.predict import predict
from remat.plan.types import Plan
from remat.verify import verify

WIDTH = 8
ROWS = 4
TENSOR_BYTES = ROWS * WIDTH * 4
"""One activation of the toy (4 x 8 float32)."""


class StopBlock(nn.Module):
    """Forward ops t, addmm, relu, add, neg. The last tensor autograd saves is relu's result
    (addmm saves its input and the transposed weight first); add and neg save nothing, so an
    early-stopping replay runs t, addmm and relu only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.neg(torch.relu(self.fc(x)) + 1.0)


class StopToy(nn.Module):
    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(StopBlock() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _toy():
    torch.manual_seed(0)
    model = StopToy()
    return model, torch.randn(ROWS, WIDTH), [f"layers.{i}" for i in range(4)]


def _addmm_add(counter: BlockOpCounter) -> list[tuple[int, int]]:
    return [(c["aten.addmm.default"], c["aten.add.Tensor"]) for c in counter.total]


@pytest.mark.parametrize("label,segments,expected", [
    # every block replays t, addmm, relu and not add, neg
    ("full", [seg(i, i + 1) for i in range(4)], [(2, 1)] * 4),
    # a two-block segment: the first block replays whole, the last stops early
    ("every:2", [seg(0, 2), seg(2, 4)], [(2, 2), (2, 1), (2, 2), (2, 1)]),
    # the outer replay ends with kept block 3 (stops early) and runs the child's blocks whole;
    # the child's own replay stops early in its last block, 1
    ("nested-first", [seg(0, 4, "recompute", seg(0, 2))], [(3, 3), (3, 2), (2, 2), (2, 1)]),
    # the outer replay ends in a nested checkpoint: it runs whole; the child's stops early
    ("nested-last", [seg(0, 4, "recompute", seg(2, 4))], [(2, 2), (2, 2), (3, 3), (3, 2)]),
])
def test_replays_stop_at_the_last_saved_tensor(label, segments, expected):
    model, batch, names = _toy()
    baseline = block_op_counts(model, batch, names)
    assert baseline.forward_keys[0] == ["aten.t.default#0", "aten.addmm.default#0", "aten.relu.default#0",
                                        "aten.add.Tensor#0", "aten.neg.default#0"]
    assert baseline.stop_keys == [3] * 4
    plan = make_plan(model, batch, names, segments, label)
    reference = train(model, batch)
    assert_identical(reference, train(model, batch, plan=plan))
    apply_(model, plan)
    counter = block_op_counts(model, batch, names)
    assert _addmm_add(counter) == expected
    assert [c["aten.relu.default"] for c in counter.total] == [a for a, _ in expected]
    assert [c["aten.neg.default"] for c in counter.total] == [n + 1 for _, n in expected]  # backward: one neg
    extra = expected_extra_calls(plan, baseline.forward_keys, baseline.stop_keys)
    assert [baseline.total[i] + extra[i] for i in range(4)] == counter.total


def test_the_profile_prices_the_stopped_replay():
    model, batch, names = _toy()
    prof = profile(model, batch, blocks=names, repeats=1)
    for block in prof.blocks:
        assert [op.key for op in block.ops] == ["aten.t.default#0", "aten.addmm.default#0", "aten.relu.default#0",
                                                "aten.add.Tensor#0", "aten.neg.default#0"]
        assert block.replay_stop_calls == replay_stop(block) == 3
        # FLOPs: addmm alone (2 * 4 * 8 * 8 plus the bias); add and neg are not replayed
        assert stopped_replay_flops(block) == sum(op.flops for op in block.ops[:3]) == block.ops[1].flops
        assert stopped_replay_ms(block) == pytest.approx(block.fwd_ms * sum(o.time_ms for o in block.ops[:3])
                                                         / sum(o.time_ms for o in block.ops))
        # the whole replay's forward peaks once neg's output exists beside relu's (saved) and
        # add's: one activation above the stopped replay's peak (relu's and addmm's)
        assert block.fwd_live_bytes[2:] == (2 * TENSOR_BYTES, 2 * TENSOR_BYTES, 3 * TENSOR_BYTES)
        forward = block.fwd_temp_bytes + replay_base_bytes(block) + saved_input_bytes(block)
        assert replay_working_bytes(block) == block.saved_bytes + max(block.bwd_temp_bytes, forward)
        assert stopped_replay_working_bytes(block) == block.saved_bytes + max(block.bwd_temp_bytes,
                                                                              forward - TENSOR_BYTES)
    # block 0 (its input is the batch, not saved): the replay's forward (256 + 136 bytes: the
    # output's gradient and 8 bytes more) is above its backward's 296, and stopped below it; the
    # other blocks' backward (424) is above either forward. The last block's output gradient is
    # the sum's broadcast scalar (8 bytes), but neg's backward, which reads nothing saved, has
    # made a full one when relu's reads its saved result, where a replay begins (136 before)
    assert [b.fwd_temp_bytes + replay_base_bytes(b) for b in prof.blocks] == [392, 264, 264, 264]
    assert [b.bwd_temp_bytes for b in prof.blocks] == [296, 424, 424, 424]
    assert [replay_working_bytes(b) - stopped_replay_working_bytes(b) for b in prof.blocks] == [392 - 296, 0, 0, 0]


@pytest.mark.parametrize("segments,whole,stopped", [
    ([seg(i, i + 1) for i in range(4)], 0, 4),
    ([seg(0, 1), seg(1, 4)], 2, 2),
    ([seg(0, 4, "recompute", seg(0, 2))], 4, 2),  # outer: 0, 1, 2 whole, 3 stopped; child: 0 whole, 1 stopped
    ([seg(0, 4, "recompute", seg(2, 4))], 5, 1),  # outer: all four whole; child: 2 whole, 3 stopped
])
def test_replays_are_priced_whole_or_stopped(segments, whole, stopped):
    model, batch, names = _toy()
    prof = profile(model, batch, blocks=names, repeats=1)
    prediction = predict(prof, segments)
    block = prof.blocks[0]  # the blocks are alike
    assert prediction.extra_flops == whole * block.fwd_flops + stopped * stopped_replay_flops(block)


@pytest.mark.parametrize("segments,peak_bytes", [
    # the peak is block 0's replay: stopped, it works under its backward (296 bytes, see above);
    # replayed whole (``early_stop=False``), 96 bytes above, 2536
    ([seg(i, i + 1) for i in range(4)], 2440),
    ([seg(0, 1), seg(1, 4)], 2440),
])
def test_predicted_peak_is_measured_to_the_byte(segments, peak_bytes):
    model, batch, names = _toy()
    prof = profile(model, batch, blocks=names, repeats=1)
    prediction = predict(prof, segments)
    assert prediction.peak_bytes == peak_bytes
    plan = Plan(segments=tuple(segments), block_names=tuple(names), strategy_name="test", budget_bytes=None,
                prediction=prediction, fingerprint=prof.fingerprint)
    check = verify(model, batch, plan, repeats=1)
    assert check.grads_identical
    assert check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes == prediction.peak_bytes


SAVE_ADDMM = ("aten.addmm.default#0",)
PAST_STOP = ("aten.add.Tensor#0",)
"""add comes after relu, the last saved tensor: a selective replay stops before it."""


def test_selective_replays_stop_at_the_last_saved_tensor_too():
    """Selective blocks caching addmm: the replay fetches addmm, runs t and relu, and stops
    before add and neg, as torch's ``early_stop`` does; gradients bit-identical; the counts are
    what `expected_extra_calls` says."""
    model, batch, names = _toy()
    baseline = block_op_counts(model, batch, names)
    plan = make_plan(model, batch, names, [seg(i, i + 1, "selective:x", saved_ops=SAVE_ADDMM) for i in range(4)])
    assert all(s.stops_early for s in plan.segments)
    reference = train(model, batch)
    assert_identical(reference, train(model, batch, plan=plan))
    apply_(model, plan)
    counter = block_op_counts(model, batch, names)
    # forward 1 + backward 0 addmm (its backward runs mm); relu 1 + 1 replayed; add 1, not replayed
    assert _addmm_add(counter) == [(1, 1)] * 4
    assert [c["aten.relu.default"] for c in counter.total] == [2] * 4
    extra = expected_extra_calls(plan, baseline.forward_keys, baseline.stop_keys)
    assert [baseline.total[i] + extra[i] for i in range(4)] == counter.total


def test_selective_plans_name_no_call_past_the_stop_and_are_measured_to_the_byte():
    """A call past the replay's stop would be cached and never fetched: `make_plan` drops it
    from ``saved_ops`` and the costs ignore it (the same price either way); the replay is priced
    to its stop (FLOPs: nothing, addmm is fetched); the peak is measured to the byte."""
    from remat.plan.costs import cost_of
    from remat.plan.planners import make_plan as plan_of
    from remat.plan.types import Segment

    model, batch, names = _toy()
    prof = profile(model, batch, blocks=names, repeats=1)
    named = [Segment(start=i, stop=i + 1, strategy="selective:x", saved_ops=SAVE_ADDMM + PAST_STOP) for i in range(4)]
    plan = plan_of(prof, tuple(named), "test", None)
    assert [s.saved_ops for s in plan.segments] == [SAVE_ADDMM] * 4
    for i in range(4):
        assert cost_of(prof, i, named[i]) == cost_of(prof, i, plan.segments[i])
        # relu is replayed (no FLOPs counted for it), addmm fetched, add and neg not reached
        assert cost_of(prof, i, plan.segments[i]).extra_flops == sum(
            op.flops for op in prof.blocks[i].ops[:3] if op.key not in SAVE_ADDMM)
    check = verify(model, batch, plan, repeats=1)
    assert check.grads_identical and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes == plan.prediction.peak_bytes
