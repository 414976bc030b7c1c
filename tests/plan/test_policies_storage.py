"""Policies on an op table with storage ids: they name only cacheable calls, and knapsack
weighs the storages a choice keeps alive (shared ones once), exactly."""

import itertools
import random

import pytest

from remat.plan.costs import cached_ops, selective_saved_bytes
from remat.plan.policies import attention_core, cacheable, knapsack, knapsack_frontier, op_cacheable, save_matmuls

from plan_toys import block, replace
from test_costs import BLOCK, rec


def test_cacheable_rule():
    assert cacheable("aten.mm.default") and cacheable("aten._unsafe_view.default") and cacheable("aten.__and__.Tensor")
    assert not cacheable("aten.empty_like.default") and not cacheable("aten.bernoulli_.float")
    assert not cacheable("aten.div_.Scalar")
    assert not cacheable("aten.mm.default", mutated_later=True)


def test_a_call_written_later_is_never_named_nor_priced_as_cached():
    # The bmm's output written into by a later call (as T5 writes its relative buckets): it is
    # replayed, never named, priced or counted among the cached calls.
    written = replace(BLOCK, ops=tuple(replace(op, mutated_later=op.key == "aten.bmm.default#0") for op in BLOCK.ops))
    assert "aten.bmm.default#0" in save_matmuls(BLOCK) and "aten.bmm.default#0" not in save_matmuls(written)
    for target in (64, 1000):
        assert "aten.bmm.default#0" not in knapsack(written, target_bytes=target)
    assert cached_ops(written, ("aten.bmm.default#0", "aten._softmax.default#0")) == {"aten._softmax.default#0"}
    assert selective_saved_bytes(written, ("aten.bmm.default#0",)) == 0
    assert op_cacheable(BLOCK.ops[0]) and not op_cacheable(written.ops[0])


# An attention block as the CPU GPT records it: dropouts are empty_like + bernoulli_ + div_ + mul.
ATTN = block(0, input_bytes=16, saved_bytes=0, ops=(
    rec("aten.native_layer_norm.default#0", 24, 0.25, ((0, 16), (1, 4), (2, 4))),
    rec("aten.addmm.default#0", 48, 2.0, ((3, 48),)),
    rec("aten.clone.default#0", 16, 0.125, ((4, 16),)),
    rec("aten.bmm.default#0", 64, 1.0, ((5, 64),)),
    rec("aten._unsafe_view.default#0", 0, 0.0625, ((5, 64),)),
    rec("aten._softmax.default#0", 64, 0.5, ((6, 64),)),
    rec("aten.empty_like.default#0", 64, 0.0625, ((7, 64),)),
    rec("aten.bernoulli_.float#0", 0, 1.0, ((7, 64),)),
    rec("aten.div_.Scalar#0", 0, 0.125, ((7, 64),)),
    rec("aten.mul.Tensor#0", 64, 0.25, ((8, 64),)),
    rec("aten.bmm.default#1", 16, 1.0, ((9, 16),)),
    rec("aten.addmm.default#1", 16, 1.0, ((10, 16),)),
    rec("aten.empty_like.default#1", 16, 0.0625, ((11, 16),)),
    rec("aten.bernoulli_.float#1", 0, 0.5, ((11, 16),)),
    rec("aten.mul.Tensor#1", 16, 0.125, ((12, 16),)),
))
SAVED_BY_AUTOGRAD = {"aten.native_layer_norm.default#0", "aten.clone.default#0", "aten._softmax.default#0",
                     "aten.empty_like.default#0", "aten.mul.Tensor#0", "aten.empty_like.default#1"}
ATTN = replace(ATTN, ops=tuple(replace(op, saved_bytes=op.output_bytes if op.key in SAVED_BY_AUTOGRAD else 0)
                               for op in ATTN.ops))


def test_attention_core_names_no_allocation_or_in_place_call():
    # Outside the core (bmm#0 .. bmm#1), autograd saves layer_norm, the q/k clone and the
    # resid-dropout mask; the mask is an empty_like filled in place, so it is replayed, not named.
    # The two projections are saved as matmuls (the out-projection only feeds the dropout).
    assert attention_core(ATTN) == ("aten.native_layer_norm.default#0", "aten.addmm.default#0", "aten.clone.default#0",
                                    "aten.addmm.default#1")


def test_save_matmuls():
    assert save_matmuls(ATTN) == ("aten.addmm.default#0", "aten.bmm.default#0", "aten.bmm.default#1", "aten.addmm.default#1")


def _brute_force(blk, target):
    items = [o.key for o in blk.ops if not o.is_view and cacheable(o.name)]
    times = {o.key: o.time_ms for o in blk.ops}
    best = 0.0
    for r in range(len(items) + 1):
        for combo in itertools.combinations(items, r):
            if selective_saved_bytes(blk, combo) <= target:
                best = max(best, sum(times[k] for k in combo))
    return best


@pytest.mark.parametrize("target", [0, 16, 24, 40, 64, 100, 128, 200, 1000])
def test_knapsack_is_exact_over_shared_storages(target):
    for blk in (BLOCK, _random_block(random.Random(target))):
        keys = knapsack(blk, target_bytes=target)
        assert selective_saved_bytes(blk, keys) <= target
        chosen = sum(o.time_ms for o in blk.ops if o.key in keys)
        assert chosen == pytest.approx(_brute_force(blk, target))


def test_a_free_view_is_not_free():
    # 64 B buys the bmm's storage, which the bmm (1 ms) and its _unsafe_view (0.125 ms) share:
    # 1.125 ms, more than softmax (0.5 ms) or mul (0.25 ms) alone. At 0 B nothing is saved.
    assert knapsack(BLOCK, target_bytes=0) == ()
    assert set(knapsack(BLOCK, target_bytes=64)) == {"aten.bmm.default#0", "aten._unsafe_view.default#0"}


def test_frontier_weights_are_storage_bytes():
    for weight, time_ms, keys in knapsack_frontier(BLOCK):
        assert selective_saved_bytes(BLOCK, keys) == weight
        assert sum(o.time_ms for o in BLOCK.ops if o.key in keys) == pytest.approx(time_ms)


def _random_block(rng):
    """Eight calls over five storages: producers, views of them, a two-output call."""
    sizes = [rng.choice([8, 16, 24, 40]) for _ in range(5)]
    ops = []
    for i in range(8):
        ids = sorted(rng.sample(range(5), rng.choice([1, 1, 2])))
        ops.append(rec(f"aten.op{i}.default#0", 0, float(rng.randint(1, 9)) / 4, tuple((s, sizes[s]) for s in ids)))
    return block(0, input_bytes=4, saved_bytes=0, ops=tuple(ops))
