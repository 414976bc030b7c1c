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


def test_selective_working_set_from_the_measured_free_order():
    # The plain backward freed storages 3, 1, 2 (64 B each), 4 (16 B) and an input's (-1, 16 B),
    # in that order; its temporaries were 20 B before any free, 90 B after two (the peak), and
    # 10 B after four. Saved 300, forward temporaries 30, output gradient 16.
    blk = replace(BLOCK, bwd_temp_bytes=90, fwd_temp_bytes=30, output_grad_bytes=16,
                  bwd_free_order=((3, 64), (1, 64), (2, 64), (4, 16), (-1, 16)),
                  bwd_free_points=((0, 20), (2, 90), (4, 10)))
    prof = profile([blk])

    def working(keys):
        return cost_of(prof, 0, Segment(start=0, stop=1, strategy="selective:x", saved_ops=keys)).working_bytes

    # Caching mul (storage 3, freed first): alive at the peak, 90 + 64 = 154; before the peak
    # the replay held nothing unsaved: 30 + 16 = 46. Working 300 + 154 = 454.
    assert working(("aten.mul.Tensor#0",)) == 454
    # Caching layer_norm (storages 4, 5, 6: only 4, freed fourth, is saved): at the peak nothing
    # of it is freed yet (90); after four frees 10 + 16 = 26; the replay holds 5 and 6 (8 B)
    # until it fetches them: 30 + 16 + 8 = 54. Working 300 + 90 = 390.
    assert working(("aten.native_layer_norm.default#0",)) == 390
    # Caching bmm (storage 0, never saved: a plain forward frees it): the replay holds its 64 B on
    # top of its own peak, 30 + 16 + 64 = 110 > 90. Working 300 + 110 = 410.
    assert working(("aten.bmm.default#0",)) == 410
    # Nothing cached: the replay's working set, 300 + max(90, 30 + 16) = 390.
    assert working(()) == 390 == replay_working_bytes(blk)
