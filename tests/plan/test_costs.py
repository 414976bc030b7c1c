"""Selective block costs: the storages the cached op calls keep alive, each counted once."""

import pytest

from remat.measure.types import OpRecord
from remat.plan.costs import cached_ops, cost_of, replay_working_bytes, selective_saved_bytes
from remat.plan.types import Segment

from plan_toys import block, profile, replace


def rec(key, output_bytes, time_ms, storages=(), *, flops=0, is_view=False, escapes=()):
    """An op call whose outputs live in ``storages``: ((id, bytes), ...); ``escapes``: the ids a
    later block reads."""
    return OpRecord(key=key, name=key.split("#")[0], output_bytes=output_bytes, saved_bytes=0, time_ms=time_ms,
                    flops=flops, is_random=False, is_view=is_view,
                    storage_ids=tuple(s for s, _ in storages), storage_bytes=tuple(b for _, b in storages),
                    storage_escapes=tuple(s in escapes for s, _ in storages))


# scores = bmm (storage 0, 64 B) -> _unsafe_view of it -> softmax (1, 64 B) -> dropout as
# empty_like (2, 64 B) + bernoulli_ + div_ on it -> mul (3, 64 B); layer_norm out/mean/rstd (4, 5, 6).
OPS = (
    rec("aten.bmm.default#0", 64, 1.0, ((0, 64),), flops=100),
    rec("aten._unsafe_view.default#0", 0, 0.125, ((0, 64),)),
    rec("aten._softmax.default#0", 64, 0.5, ((1, 64),), flops=10),
    rec("aten.empty_like.default#0", 64, 0.0625, ((2, 64),)),
    rec("aten.bernoulli_.float#0", 0, 2.0, ((2, 64),), flops=0),
    rec("aten.div_.Scalar#0", 0, 0.25, ((2, 64),), flops=64),
    rec("aten.mul.Tensor#0", 64, 0.25, ((3, 64),), flops=16),
    rec("aten.t.default#0", 0, 0.0625, (), is_view=True),
    rec("aten.native_layer_norm.default#0", 24, 0.5, ((4, 16), (5, 4), (6, 4)), flops=8),
)
BLOCK = block(0, input_bytes=16, saved_bytes=300, fwd_ms=5.0, ops=OPS)
PROFILE = profile([BLOCK])


def _cost(saved_ops):
    return cost_of(PROFILE, 0, Segment(start=0, stop=1, strategy="selective:x", saved_ops=saved_ops))


def test_a_view_of_a_replayed_op_keeps_its_storage():
    # The _unsafe_view allocates nothing, but caching it holds the bmm's 64 B storage.
    assert selective_saved_bytes(BLOCK, ("aten._unsafe_view.default#0",)) == 64


def test_shared_storage_counts_once():
    assert selective_saved_bytes(BLOCK, ("aten.bmm.default#0", "aten._unsafe_view.default#0")) == 64
    assert selective_saved_bytes(BLOCK, ("aten.bmm.default#0", "aten._softmax.default#0")) == 128


def test_multi_output_op_keeps_every_output():
    assert selective_saved_bytes(BLOCK, ("aten.native_layer_norm.default#0",)) == 24


def test_allocation_and_in_place_calls_are_never_cached():
    named = ("aten.empty_like.default#0", "aten.bernoulli_.float#0", "aten.div_.Scalar#0", "aten.mul.Tensor#0")
    assert cached_ops(BLOCK, named) == frozenset({"aten.mul.Tensor#0"})
    assert selective_saved_bytes(BLOCK, named) == 64


def test_selective_cost_by_hand():
    # Cache bmm + its view + mul (div_ is named but in place): retained = input 16 + storages 0 and 3 (64 + 64) = 144.
    # Replayed (views excluded): softmax 0.5 + empty_like 0.0625 + bernoulli_ 2.0 + div_ 0.25
    # + layer_norm 0.5 = 3.3125 ms; FLOPs 10 + 0 + 64 + 8 = 82.
    cost = _cost(("aten.bmm.default#0", "aten._unsafe_view.default#0", "aten.mul.Tensor#0", "aten.div_.Scalar#0"))
    assert cost.retained_bytes == 144
    # Working set: replay (saved 300 + temporaries 0) + the cached storages again (128).
    assert cost.working_bytes == 428
    assert cost.extra_ms == pytest.approx(3.3125)
    assert cost.extra_flops == 82


def test_the_block_output_is_counted_with_its_reader():
    # The add's storage 0 is read by the next block (its input, held there): caching adds nothing;
    # the mm's storage 1 is the block's own.
    out = block(0, input_bytes=4, saved_bytes=8, ops=(
        rec("aten.mm.default#0", 8, 1.0, ((1, 8),)),
        rec("aten.add.Tensor#0", 8, 0.5, ((0, 8),), escapes=(0,)),
    ))
    assert selective_saved_bytes(out, ("aten.add.Tensor#0",)) == 0
    assert selective_saved_bytes(out, ("aten.add.Tensor#0", "aten.mm.default#0")) == 8


def test_without_storage_ids_an_op_counts_its_own_output():
    # Profiles recorded without storage ids: each call's new bytes, as one private storage.
    old = block(0, input_bytes=4, saved_bytes=8, ops=(
        OpRecord(key="aten.mm.default#0", name="aten.mm.default", output_bytes=8, saved_bytes=8, time_ms=1.0,
                 flops=0, is_random=False, is_view=False),
        OpRecord(key="aten.view.default#0", name="aten.view.default", output_bytes=0, saved_bytes=0, time_ms=0.0,
                 flops=0, is_random=False, is_view=True),
    ))
    assert selective_saved_bytes(old, ("aten.mm.default#0", "aten.view.default#0")) == 8


def test_unknown_op_is_an_error():
    with pytest.raises(ValueError, match=r"block 'blocks.0' has no op call\(s\) \['aten.mm.default#0'\]"):
        selective_saved_bytes(BLOCK, ("aten.mm.default#0",))


def test_selective_working_set_from_the_forward_curve():
    # The plain forward's live bytes after each call (beyond the block's start): the bmm's 64 B,
    # a peak of 256 during the dropout, 216 at the end. Autograd saves storages 3, 1, 2, 4 (the
    # backward's free order), not the bmm's (0) nor layer_norm's mean and rstd (5, 6). Saved 240,
    # forward temporaries 16 (240 + 16 = the curve's 256), output gradient 16, backward
    # temporaries 20, input 16.
    blk = replace(BLOCK, saved_bytes=240, bwd_temp_bytes=20, fwd_temp_bytes=16, output_grad_bytes=16,
                  fwd_live_bytes=(64, 64, 192, 256, 256, 256, 192, 192, 216),
                  bwd_free_order=((3, 64), (1, 64), (2, 64), (4, 16), (-1, 16)))
    prof = profile([blk])

    def working(keys, block_profile=prof):
        segment = Segment(start=0, stop=1, strategy="selective:x", saved_ops=keys)
        return cost_of(block_profile, 0, segment).working_bytes

    # Nothing cached: the replay's own working set, 240 + max(20, 16 + 16) = 272.
    assert working(()) == 272 == replay_working_bytes(blk)
    # Caching mul (storage 3, made by call 6): during the dropout (calls 3-5) the replay holds it
    # on top of the curve's 256: a rise of 64, 240 + 16 + 16 + 64 = 336.
    assert working(("aten.mul.Tensor#0",)) == 336
    # Caching layer_norm (storages 4, 5, 6: 24 B, made by the last call): a rise of 24, 296; its
    # forward holds mean and rstd (8 B autograd would not keep) at the end, 16 + 216 + 8 = 240.
    assert working(("aten.native_layer_norm.default#0",)) == 296
    # Caching bmm (storage 0, made by the first call, never saved): the replay fetches it at once
    # (no rise, 272), but the forward keeps it through the dropout: 16 + 256 + 64 = 336.
    assert working(("aten.bmm.default#0",)) == 336
    # bmm and layer_norm: replay 240 + 32 + 24 = 296; forward 16 + 256 + 64 = 336.
    both = ("aten.bmm.default#0", "aten.native_layer_norm.default#0")
    assert working(both) == 336
    # A profile without the curve: the replay's working set plus every cached byte, 272 + 88.
    assert working(both, profile([replace(blk, fwd_live_bytes=())])) == 360
    # With the checkpointed forward's own curve (autograd keeps nothing: 64 B less during the
    # dropout), bmm's forward is at most that curve plus its 64 B at each call: 16 + 192 + 64 =
    # 272, the replay's; the lesser of the two bounds counts at each call.
    measured = profile([replace(blk, checkpointed_fwd_live_bytes=(64, 64, 128, 192, 192, 192, 128, 128, 88))])
    assert working(("aten.bmm.default#0",), measured) == 272
    assert working(("aten.mul.Tensor#0",), measured) == 336  # the replay's rise, as before


def test_checkpointed_forward_counts_a_cached_output_from_the_call_that_would_free_it():
    # mm (storage 0, never saved) -> gelu (1, saved) -> mm (2); both forwards hold all three to
    # the end: curves 100, 200, 300. Saved 100, forward temporaries 200, backward 50, output
    # gradient 16: the backward needs 100 + max(50, 200 + 16) = 316.
    ops = (rec("aten.mm.default#0", 100, 1.0, ((0, 100),)), rec("aten.gelu.default#0", 100, 1.0, ((1, 100),)),
           rec("aten.mm.default#1", 100, 1.0, ((2, 100),)))
    blk = replace(block(0, input_bytes=16, saved_bytes=100, ops=ops), bwd_temp_bytes=50, fwd_temp_bytes=200,
                  output_grad_bytes=16, fwd_live_bytes=(100, 200, 300), checkpointed_fwd_live_bytes=(100, 200, 300),
                  bwd_free_order=((1, 100),))

    def working(freed_at):
        prof = profile([replace(blk, checkpointed_fwd_freed_at=freed_at)])
        return cost_of(prof, 0, Segment(start=0, stop=1, strategy="selective:x", saved_ops=("aten.mm.default#0",))).working_bytes

    # The checkpointed forward still holds the cached mm output at its peak: counted once,
    # 16 + 300 = 316, the backward's.
    assert working((3, 3, 3)) == 316
    # Freed from call 1 in that forward: the cache holds it on top from then, 16 + 300 + 100.
    assert working((1, 3, 3)) == 416
    # Without free points, or with a different number of storages than the op table names: from
    # the call that made it, the upper bound 416.
    assert working(()) == 416 and working((3, 3)) == 416


def test_a_selective_forward_starts_beside_what_a_recomputed_one_does():
    # The code frees 40 B it held before the block starts, so what it holds beside the block's
    # forward measures -40 (``fwd_other_bytes``, signed), below the 16 B input a checkpoint holds.
    # The checkpointed forward peaks at 300 with a 500 B output left to nobody (LW-DETR's last
    # decoder layer): a recomputed block's forward is 16 + 0 + 300 = 316; the selective one,
    # caching nothing, counted -40 + 300 = 260 before, under its measured 316.
    ops = (rec("aten.mm.default#0", 100, 1.0, ((0, 100),)), rec("aten.gelu.default#0", 100, 1.0, ((1, 100),)),
           rec("aten.mm.default#1", 100, 1.0, ((2, 100),)))
    blk = replace(block(0, input_bytes=16, saved_bytes=100, ops=ops), bwd_temp_bytes=10, fwd_temp_bytes=100,
                  output_grad_bytes=16, fwd_live_bytes=(100, 200, 300), checkpointed_fwd_live_bytes=(100, 200, 300),
                  bwd_free_order=((1, 100),), fwd_other_bytes=-40, held_input_bytes=16)
    prof = profile([blk])
    selective = cost_of(prof, 0, Segment(start=0, stop=1, strategy="selective:x")).working_bytes
    # the backward needs 100 + max(10, 100 + 16) + 16 (the held input) = 232: the forward's 316 is the most
    assert selective == 316
    from remat.plan.phases import segment_forward_bytes

    assert segment_forward_bytes(prof, 0, 1) == 316
