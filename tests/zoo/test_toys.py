"""The dataflow between blocks on toys counted by hand, and the memory model against the measured
peak to the byte: a shared input counted once, a skip connection retained, code between blocks."""

from __future__ import annotations

import pytest

from remat.apply.opcount import BlockOpCounter
from remat.measure.profile import profile
from remat.plan.joins import joins
from remat.plan.planners import make_plan
from remat.plan.types import Segment
from remat.verify import verify
from toys import B, UNIT, toy

WIDE = B * 16 * 8 * 4
"""The pool toy's block 0 activations: (B, 16, 8) fp32."""
POOLED = B * 16 * 4 * 4
"""After the pool: (B, 16, 4) fp32; its int64 indices are twice that."""


@pytest.fixture(scope="module")
def profiles():
    found = {}
    for name in ("shared", "shared-unsaved", "skip", "pool"):
        model, batch, optimizer = toy(name)
        found[name] = (model, batch, optimizer, profile(model, batch, optimizer=optimizer, repeats=1))
    return found


FIELDS = ("saved_bytes", "held_input_bytes", "unsaved_input_bytes", "shared_entry_bytes", "handoff_bytes",
          "handoff_next_bytes", "between_saved_bytes", "entry_bytes")


@pytest.mark.parametrize("name, expected", [
    # block 0 saves its input, the tanh's output and the shared s (first saver); its checkpoint
    # holds x and s; later blocks count s nowhere: block 0 holds it whatever its strategy
    ("shared", [(3 * UNIT, 2 * UNIT, 0, 0, 0, 0, 0, 0), (2 * UNIT, UNIT, 0, 0, 0, 0, 0, 0),
                (2 * UNIT, UNIT, 0, 0, 0, 0, 0, 0)]),
    # no block saves s: counted once, from its first taker on (shared_entry), in every plan
    ("shared-unsaved", [(2 * UNIT, UNIT, 0, UNIT, 0, 0, 0, UNIT), (2 * UNIT, UNIT, 0, 0, 0, 0, 0, 0),
                        (2 * UNIT, UNIT, 0, 0, 0, 0, 0, 0)]),
    # block 0's output (saved by its last tanh) is held by block 1 and by block 2's skip: handed
    # off from block 1's entry on, whatever block 0 does; block 1's output by block 2 alone
    ("skip", [(3 * UNIT, UNIT, 0, 0, UNIT, 0, 0, 0), (2 * UNIT, 0, 0, 0, UNIT, UNIT, 0, UNIT),
              (2 * UNIT, 0, 0, 0, 0, 0, 0, UNIT)]),
    # the pool saves block 0's output (handed off) and int64 indices (code between, kept)
    ("pool", [(3 * WIDE, WIDE, 0, 0, WIDE, 0, 0, 0),
              (3 * POOLED, POOLED, 0, 0, 0, 0, 2 * POOLED, 2 * POOLED + WIDE)]),
])
def test_dataflow_terms_by_hand(profiles, name, expected):
    prof = profiles[name][3]
    assert [tuple(getattr(b, f) for f in FIELDS) for b in prof.blocks] == expected
    assert (prof.fixed_pre_saved_bytes, prof.fixed_post_saved_bytes) == (0, 0)


def test_sources_and_storage_identity(profiles):
    shared = profiles["shared"][3]
    rows = [[(i.argument, i.source, i.storage_bytes) for i in b.inputs] for b in shared.blocks]
    assert rows == [[("args[0]", "outside", UNIT), ("args[1]", "shared", UNIT)]] + [
        [("args[0]", "previous", UNIT), ("args[1]", "shared", UNIT)]] * 2
    assert len({b.inputs[1].storage for b in shared.blocks}) == 1  # one storage: s
    assert len({b.inputs[0].storage for b in shared.blocks}) == 3
    skip = profiles["skip"][3]
    assert [(i.argument, i.source) for i in skip.blocks[2].inputs] == [("args[0]", "previous"), ("skip", "block:0")]
    assert skip.blocks[2].inputs[1].storage == skip.blocks[1].inputs[0].storage  # y0, twice
    assert [(i.argument, i.source) for i in profiles["pool"][3].blocks[1].inputs] == [("args[0]", "between")]


@pytest.mark.parametrize("name, expected", [
    ("shared", (True, True)), ("shared-unsaved", (True, True)),
    ("skip", (False, False)),  # block 0 hands off to a skip; block 2 takes another argument
    ("pool", (False,)),  # code between saves
])
def test_joins(profiles, name, expected):
    assert joins(profiles[name][3]) == expected


def _segments(num_blocks: int, kinds: str) -> tuple[Segment, ...]:
    """``kinds``: one letter per block, k(eep) or r(ecompute); ``"R"``: one segment of all."""
    if kinds == "R":
        return (Segment(start=0, stop=num_blocks, strategy="recompute"),)
    return tuple(Segment(start=i, stop=i + 1, strategy={"k": "keep", "r": "recompute"}[c]) for i, c in enumerate(kinds))


@pytest.mark.parametrize("name, plans", [
    ("shared", ["kkk", "rrr", "rkk", "krr", "R"]),
    ("skip", ["kkk", "rrr", "rkk", "krr", "rkr"]),
    ("pool", ["kk", "rr", "rk", "kr"]),
])
def test_predicted_peak_is_the_measured_one_to_the_byte(profiles, name, plans):
    model, batch, optimizer, prof = profiles[name]
    for kinds in plans:
        plan = make_plan(prof, _segments(prof.num_blocks, kinds), kinds, None)
        check = verify(model, batch, plan, optimizer=optimizer, repeats=1)
        assert check.grads_identical and check.recompute_counts_match, kinds
        assert check.measured_peak_bytes == plan.prediction.peak_bytes, kinds


def test_a_shared_tensor_no_block_saves_is_counted_while_a_checkpoint_holds_it(profiles):
    """A checkpoint of a block taking it holds it (counted from its first taker on); with none, it
    is freed after the forward and counted in no backward phase (`remat.plan.predict.dead_shared_bytes`)."""
    model, batch, optimizer, prof = profiles["shared-unsaved"]
    for kinds in ("kkk", "rrr", "rkk", "krr", "R"):
        plan = make_plan(prof, _segments(3, kinds), kinds, None)
        check = verify(model, batch, plan, optimizer=optimizer, repeats=1)
        assert check.measured_peak_bytes == plan.prediction.peak_bytes, kinds


def test_op_counts_leave_the_code_between_blocks_to_no_block():
    """The pool's backward runs between block 1's backward and block 0's: counted for neither (a
    chain's counter gave it to block 1), so both blocks count the ops of their own backward."""
    model, batch, _ = toy("pool")
    with BlockOpCounter(list(model.blocks)) as counter:
        model(batch).backward()
    pool_backward = "aten.max_pool2d_with_indices_backward.default"
    assert all(pool_backward not in counts for counts in counter.total)
    # each block: its two Linears' mm in the forward, and for each an input and a weight gradient in
    # the backward; its two ReLU backwards
    assert [counts["aten.threshold_backward.default"] for counts in counter.total] == [2, 2]
    assert [counts["aten.mm.default"] for counts in counter.total] == [2 + 4, 2 + 4]
