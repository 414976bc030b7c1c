"""Blocks alike in structure (equal op tables but for times) share the optimal search's option
pricing: the union of their knapsack frontiers, priced by one vectorized formula that equals
`cost_of` bit for bit, and the plan stays the optimum of the enumerated space."""

import random

import pytest

from remat.plan.costs import cost_of, selective_prices
from remat.plan.planners import plan
from remat.plan.policies import knapsack_frontier, knapsack_frontier_union
from remat.plan.search import OptimalSearch, block_options, structure_classes
from remat.plan.types import Segment

from plan_toys import profile, replace
from test_optimal import _best, _space
from test_policies_storage import ATTN


def _jittered(index: int, rng: random.Random):
    """ATTN with every op's time scaled by its own factor in [0.5, 1.5)."""
    ops = tuple(replace(op, time_ms=op.time_ms * (0.5 + rng.random())) for op in ATTN.ops)
    return replace(ATTN, index=index, name=f"blocks.{index}", ops=ops, fwd_ms=sum(o.time_ms for o in ops))


@pytest.mark.parametrize("seed", range(4))
def test_union_holds_every_blocks_frontier(seed):
    rng = random.Random(seed)
    blocks = [_jittered(i, rng) for i in range(6)]
    union = knapsack_frontier_union(blocks)
    assert len(set(union)) == len(union)
    for blk in blocks:
        own = {(w, keys) for w, _, keys in knapsack_frontier(blk)}
        assert own <= set(union)
    # one block: exactly its own frontier, in the same order
    assert knapsack_frontier_union(blocks[:1]) == [(w, keys) for w, _, keys in knapsack_frontier(blocks[0])]


def test_equal_points_are_offered_once():
    """Ops alike in bytes and time give many subsets of equal bytes and time: one is kept."""
    ops = tuple(replace(ATTN.ops[2], key=f"aten.clone.default#{k}", storage_ids=(k,)) for k in range(12))
    blk = replace(ATTN, ops=ops)
    union = knapsack_frontier_union([blk, blk])
    assert [w for w, _ in union] == [16 * k for k in range(13)]


def test_vectorized_prices_equal_cost_of_bit_for_bit():
    rng = random.Random(7)
    blocks = [replace(_jittered(i, rng), selective_overhead_ms=rng.random(), selective_cache_overhead_ms=rng.random())
              for i in range(5)]
    prof = profile(blocks)
    choices = [keys for _, keys in knapsack_frontier_union(blocks)] + [(), ("aten.addmm.default#0",)]
    prices = selective_prices(blocks, choices)
    for b in range(len(blocks)):
        for k, keys in enumerate(choices):
            cost = cost_of(prof, b, Segment(start=b, stop=b + 1, strategy="selective:knapsack", saved_ops=keys))
            assert cost.extra_ms == prices.extra_ms[b, k]
            assert (cost.retained_bytes, cost.working_bytes, cost.extra_flops) == (
                prices.retained_bytes[k], prices.working_bytes[k], prices.extra_flops[k])


def test_structure_classes_ignore_times_only():
    rng = random.Random(1)
    blocks = [_jittered(i, rng) for i in range(4)]
    blocks[2] = replace(blocks[2], input_bytes=32)  # bytes differ: its own class
    blocks[3] = replace(blocks[3], recompute_overhead_ms=5.0, bwd_ms=9.0)  # times only: alike
    assert structure_classes(profile(blocks)) == [[0, 1, 3], [2]]
    blocks[1] = replace(blocks[1], fwd_live_bytes=(4,) * len(blocks[1].ops))  # its forward lives differently
    assert structure_classes(profile(blocks)) == [[0, 3], [1], [2]]


@pytest.mark.parametrize("seed", range(3))
def test_shared_options_keep_the_optimum(seed):
    """Three blocks alike in structure, times differing: the plan is the best of the enumerated
    space (`block_options`: the union), which is no slower than each block's own frontier."""
    rng = random.Random(seed)
    small = tuple(replace(op, output_bytes=op.output_bytes // 16, storage_bytes=tuple(b // 16 for b in op.storage_bytes),
                          saved_bytes=op.saved_bytes // 16) for op in ATTN.ops[:6])
    base = replace(ATTN, ops=small, input_bytes=1, saved_bytes=sum(o.saved_bytes for o in small), bwd_temp_bytes=2)
    blocks = []
    for i in range(3):
        ops = tuple(replace(op, time_ms=float(rng.randint(1, 8)) / 4) for op in small)
        blocks.append(replace(base, index=i, name=f"blocks.{i}", ops=ops, fwd_ms=sum(o.time_ms for o in ops)))
    prof = profile(blocks, param_bytes=4, grad_bytes=4)
    assert structure_classes(prof) == [[0, 1, 2]]
    for i in range(3):  # every block's own frontier is offered to it
        offered = {s.saved_ops for s in block_options(prof, i) if s.strategy == "selective:knapsack"}
        assert {keys for _, _, keys in knapsack_frontier(blocks[i])} <= offered
    space = _space(prof)
    for budget in sorted({space[0][0], space[len(space) // 2][0], space[-1][0]}):
        got = plan(prof, budget=budget)
        assert got.prediction.peak_bytes <= budget
        assert got.prediction.step_ms == pytest.approx(_best(space, budget))
    assert OptimalSearch(prof).optimality(space[len(space) // 2][0]).exact


def test_the_head_strategies_searches_price_the_blocks_once():
    """`remat.pareto` and `remat.plan` search once per head strategy; the strategy changes only the
    post part, so the searches share one pricing of the blocks' options. On a measured Llama with
    its LM head (two head strategies worth searching), the shared options equal each profile's own
    pricing option for option, and the plans equal those of searches that price apart. A profile
    whose blocks are other objects (a variant) prices apart."""
    import dataclasses

    import numpy as np
    import torch

    import remat
    from remat.models import build
    from remat.plan.chain_problem import ChainBuilder
    from remat.plan.head import head_choices, priced_profile
    from remat.plan.planners import head_searches, optimal_search

    torch.manual_seed(0)
    built = build("hf:llama", num_layers=2, seq_len=64, batch_size=2)
    prof = remat.profile(built.model, built.batch, built.loss_fn, None, repeats=1)
    heads = head_choices(prof)
    assert len(heads) == 2
    shared = head_searches(prof, heads)
    apart = {h: optimal_search(priced_profile(prof, h)) for h in heads}
    assert shared[heads[1]].options() is shared[heads[0]].options()
    assert apart[heads[1]].options() is not apart[heads[0]].options()
    for h in heads:
        for mine, own in zip(shared[h].options(), apart[h].options(), strict=True):
            assert mine.segments == own.segments
            for field in ("retained_bytes", "working_bytes", "extra_ms"):
                assert np.array_equal(getattr(mine, field), getattr(own, field)), (h, field)
        assert shared[h].frontier_segments() == apart[h].frontier_segments()
    moved = dataclasses.replace(prof, blocks=tuple(dataclasses.replace(b) for b in prof.blocks))
    builder = ChainBuilder(moved)
    builder.share_pricing(shared[heads[0]].builder)
    assert builder.options() is not shared[heads[0]].options()
