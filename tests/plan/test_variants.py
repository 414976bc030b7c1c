"""The exact search against `predict` where a term depends on other blocks' strategies
(`remat.plan.variants`): a mask no checkpoint holds, a kept block's forward after a kept block,
a recomputed block's forward beside what the code holds of the block before.

Toy chains whose every layout (keep / recompute per block, nested recompute segments) is priced
by `predict`: at every layout's own peak the plan is as fast as the fastest layout that fits, and
every point of the search's curve is the peak and time `predict` gives its layout.
"""

from __future__ import annotations

import pytest

from remat.measure.types import BlockInput
from remat.plan.joins import joins
from remat.plan.planners import optimal_search, plan
from remat.plan.predict import predict
from remat.plan.types import Segment
from remat.plan.variants import KeptNeighbour, KeptSaver, SharedGroup, kept_neighbours, kept_savers, shared_groups

from plan_space import element_tables, layouts
from plan_toys import block, profile, replace

MASK = 16


def _mask_chain():
    """Block 0 takes nothing shared; blocks 1 and 2 take one 16-byte mask no block saves
    (counted at block 1): keeping both, nothing holds it in the backward."""
    mask = BlockInput(argument="mask", storage=99, storage_bytes=MASK, source="shared", counted="shared")
    later = replace(mask, counted="earlier")
    blocks = [block(0, input_bytes=8, saved_bytes=40, fwd_ms=3.0),
              replace(block(1, input_bytes=8, saved_bytes=24, fwd_ms=1.0), inputs=(mask,), entry_bytes=MASK,
                      shared_entry_bytes=MASK),
              replace(block(2, input_bytes=8, saved_bytes=24, fwd_ms=1.0), inputs=(later,))]
    return profile(blocks)


def _freed_mask_chain():
    """Blocks 0 and 1 take a 16-byte mask no block saves (counted at block 0); the model's code
    frees it before block 2, whose forward (60 bytes of temporaries) is the larger part of its
    working set: its ``fwd_other_bytes`` counts the mask out, and a checkpoint of block 0 or 1
    keeps it alive there (an audio tower's mask, then a language model's layers)."""
    mask = BlockInput(argument="mask", storage=99, storage_bytes=MASK, source="shared", counted="shared")
    later = replace(mask, counted="earlier")
    blocks = [replace(block(0, input_bytes=8, saved_bytes=24, fwd_ms=1.0), inputs=(mask,), entry_bytes=MASK,
                      shared_entry_bytes=MASK, fwd_other_bytes=0),
              replace(block(1, input_bytes=8, saved_bytes=24, fwd_ms=1.0), inputs=(later,), fwd_other_bytes=0),
              replace(block(2, input_bytes=8, saved_bytes=24, fwd_ms=3.0), fwd_temp_bytes=60, fwd_other_bytes=-MASK,
                      shared_freed=((99, MASK),))]
    return profile(blocks)


def _freed_in_between_chain():
    """As `_freed_mask_chain`, the code before block 2 peaking 40 bytes above its start with the
    mask still alive and freeing it after (e3nn's edge features): 24 above the start without it."""
    prof = _freed_mask_chain()
    blocks = list(prof.blocks)
    blocks[2] = replace(blocks[2], fwd_temp_bytes=8, between_fwd_peak_bytes=40 + 60, between_fwd_apart_bytes=24 + 60,
                        shared_freed_between=(99,))
    return replace(prof, blocks=tuple(blocks))


def _saved_shared_chain():
    """Block 0 takes a 16-byte shared tensor first and does not save it (counted at block 0);
    block 1 takes it and saves it first (its saved bytes count it too); block 2's forward (60 bytes
    of temporaries) is the larger part of its working set, measured with it counted out
    (``fwd_other_bytes``): where block 1 is not kept, nothing else counts it there (RT-DETR's
    reference points with LoRA, taken first by its frozen query-position head)."""
    mask = BlockInput(argument="mask", storage=99, storage_bytes=MASK, source="shared", counted="shared")
    later = replace(mask, counted="earlier")
    blocks = [replace(block(0, input_bytes=8, saved_bytes=24, fwd_ms=1.0), inputs=(mask,), entry_bytes=MASK,
                      shared_entry_bytes=MASK, fwd_other_bytes=0),
              replace(block(1, input_bytes=8, saved_bytes=24 + MASK, fwd_ms=1.0), inputs=(later,), fwd_other_bytes=0),
              replace(block(2, input_bytes=8, saved_bytes=24, fwd_ms=3.0), fwd_temp_bytes=60, fwd_other_bytes=-MASK,
                      shared_saved=((99, MASK, 1),))]
    return profile(blocks)


def _skip_chain():
    """Block 1's forward (large temporaries) is its working set's larger part, and holds block 0's
    output (8 bytes the model's code keeps) when block 0 is not kept."""
    blocks = [replace(block(0, input_bytes=8, saved_bytes=40, fwd_ms=3.0), output_held_bytes=8, fwd_other_bytes=0),
              replace(block(1, input_bytes=8, saved_bytes=24, fwd_ms=1.0), fwd_temp_bytes=60, fwd_other_bytes=0),
              replace(block(2, input_bytes=8, saved_bytes=24, fwd_ms=1.0), fwd_other_bytes=0)]
    return profile(blocks)


def _held_forward_chain():
    """Block 1's checkpointed forward (70 bytes at its height) is its larger part; the model's
    code holds block 0's output (8 bytes) through it when block 0 is not kept (GPT-NeoX-Japanese's
    layers return their attention weights, held by the loop until the next layer returns)."""
    blocks = [replace(block(0, input_bytes=8, saved_bytes=40, fwd_ms=3.0), output_held_bytes=8, fwd_other_bytes=0),
              replace(block(1, input_bytes=8, saved_bytes=24, fwd_ms=1.0), fwd_other_bytes=0,
                      checkpointed_fwd_live_bytes=(70,)),
              replace(block(2, input_bytes=8, saved_bytes=24, fwd_ms=1.0), fwd_other_bytes=0)]
    return profile(blocks)


def _every_layout(prof):
    out = {}
    for elements in layouts(element_tables(prof, joins(prof), options=False)):
        segments = tuple(e.segment for e in elements)
        prediction = predict(prof, segments)
        out[segments] = (prediction.peak_bytes, prediction.step_ms)
    return out


def test_groups_and_neighbours_found():
    assert shared_groups(_mask_chain()) == [SharedGroup(takers=frozenset({1, 2}), first=1, num_bytes=MASK,
                                                        storages=frozenset({99}))]
    assert kept_neighbours(_skip_chain()) == [KeptNeighbour(block=1, num_bytes=8)]
    assert kept_neighbours(_held_forward_chain()) == [KeptNeighbour(block=1, num_bytes=8)]


def test_a_segment_forward_holds_what_the_code_keeps_of_the_block_before():
    """Recompute blocks 0 and 1: block 1's checkpointed forward (70) runs beside block 0's
    checkpoint input (8), its own input (8) and block 0's output the code still holds (8): 94.
    Keep block 0: its saved bytes (40) hold that output, so nothing is added: 40 + 8 + 70."""
    prof = _held_forward_chain()
    both = (_seg(0, "recompute"), _seg(1, "recompute"), _seg(2, "keep"))
    assert predict(prof, both).peak_bytes == 8 + 8 + 70 + 8
    kept = (_seg(0, "keep"), _seg(1, "recompute"), _seg(2, "keep"))
    assert predict(prof, kept).peak_bytes == 40 + 8 + 70


@pytest.mark.parametrize("make", [_mask_chain, _skip_chain, _held_forward_chain, _freed_mask_chain,
                                  _freed_in_between_chain, _saved_shared_chain])
def test_search_curve_is_predict_and_optimal(make):
    prof = make()
    space = _every_layout(prof)
    search = optimal_search(prof)
    for need, cost_ms, variant in search.exact_curve():
        segments = search.exact_segments(need, variant)
        prediction = predict(prof, segments)
        assert prediction.peak_bytes == int(search.builder.fixed.peak_bytes(need))
        assert prediction.extra_ms == pytest.approx(cost_ms, abs=1e-12)
    for peak in sorted({p for p, _ in space.values()}):
        fastest = min(ms for p, ms in space.values() if p <= peak)
        got = plan(prof, peak)
        assert got.prediction.peak_bytes <= peak
        assert got.prediction.step_ms == pytest.approx(fastest, abs=1e-12), peak


def test_mask_left_out_when_no_checkpoint_holds_it():
    """Recompute block 0, keep blocks 1 and 2: the mask is not held in the backward, and the
    search offers that layout at its own peak (counting the mask it would not)."""
    prof = _mask_chain()
    layout = (_seg(0, "recompute"), _seg(1, "keep"), _seg(2, "keep"))
    # block 2's backward: block 0's input, block 1's saved bytes, block 2's own (no mask)
    assert predict(prof, layout).peak_bytes == 8 + 24 + 24
    # recomputing block 1 too peaks there as well, 1 ms slower: counting the mask (72 bytes), the
    # search would have taken it
    slower = (_seg(0, "recompute"), _seg(1, "recompute"), _seg(2, "keep"))
    assert predict(prof, slower).peak_bytes == 56
    assert predict(prof, slower).extra_ms == predict(prof, layout).extra_ms + 1.0
    assert plan(prof, 56).segments == layout


def test_a_freed_mask_a_checkpoint_holds_counts_in_a_later_forward():
    """Recompute block 0, keep blocks 1 and 2: block 0's checkpoint holds its input (8) and the
    mask (16) through block 2's forward, which the code ran without the mask in the profiled
    step: 8 + 16 + 24 (block 1's saved bytes) + 24 + 60 (block 2's forward) = 132. Keep all
    three: the mask is gone there, 24 + 24 + 24 + 60 = 132 as well, block 0's saved bytes in
    place of its checkpoint."""
    prof = _freed_mask_chain()
    assert shared_groups(prof) == [SharedGroup(takers=frozenset({0, 1}), first=0, num_bytes=MASK,
                                               storages=frozenset({99}))]
    recomputed = (_seg(0, "recompute"), _seg(1, "keep"), _seg(2, "keep"))
    assert predict(prof, recomputed).peak_bytes == 8 + MASK + 24 + 24 + 60
    kept = (_seg(0, "keep"), _seg(1, "keep"), _seg(2, "keep"))
    assert predict(prof, kept).peak_bytes == 24 + 24 + 24 + 60


def _seg(i, strategy):
    return Segment(start=i, stop=i + 1, strategy=strategy)


def test_a_shared_tensor_a_later_block_saves_counts_where_that_block_is_not_kept():
    """`_saved_shared_chain`: block 2's forward holds the shared tensor through block 1's saved
    bytes where block 1 is kept; where it is recomputed, the tensor (held by its checkpoint, and by
    the first taker's entry) is counted there all the same, not 16 bytes short."""
    prof = _saved_shared_chain()
    kept = (_seg(0, "keep"), _seg(1, "keep"), _seg(2, "keep"))
    recomputed = (_seg(0, "keep"), _seg(1, "recompute"), _seg(2, "keep"))
    # block 2's forward: block 0's saved bytes and entry, block 1's saved bytes (the tensor among
    # them), its own saved bytes and temporaries, less the tensor its measured forward counts out
    assert predict(prof, kept).peak_bytes == 24 + MASK + (24 + MASK) + 24 + 60 - MASK
    # block 1 recomputed holds its input (8 bytes), and the tensor counts once more in block 2's forward
    assert predict(prof, recomputed).peak_bytes == 24 + MASK + 8 + 24 + 60
    assert kept_savers(prof) == [KeptSaver(block=1, num_bytes=MASK)]
