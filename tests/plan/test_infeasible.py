"""Budgets no plan meets: the error states the least feasible peak and what sets it."""

import pytest

from remat.plan.planners import plan

from plan_toys import block, chain, profile

MIB = 2**20


def test_model_state_overflow_names_remedies_with_numbers():
    # AdamW: params 1 GiB, grads 1 GiB, state 2 GiB = 4 GiB of model state against 3 GiB.
    prof = chain(2, input_bytes=MIB, saved_bytes=4 * MIB, param_bytes=2**30, grad_bytes=2**30,
                 optimizer_state_bytes=2**31, optimizer_name="AdamW")
    with pytest.raises(ValueError) as info:
        plan(prof, budget=3 * 2**30)
    text = str(info.value)
    assert "Model state alone needs 4.00 GiB" in text
    assert "does not remove parameters, gradients or optimizer-state storage" in text
    assert "ZeRO-1: fits from 2 data-parallel ranks (3.00 GiB per rank)" in text  # 1 + 1 + 2/2
    assert "8-bit optimizer state" in text and "optimizer offload to host" in text


def test_zero3_remedy_counts_what_fsdp2_gathers_per_block():
    """ZeRO-3's world size counts FSDP2's buffers, one block per unit: the running block's weights
    and gradients, the next block's weights, the reduce-scatter input of the block before."""
    from dataclasses import replace

    blocks = [replace(block(i, input_bytes=MIB, saved_bytes=4 * MIB), grad_bytes=2**29) for i in range(2)]
    # AdamW: params 1 GiB, grads 1 GiB, state 2 GiB against 3 GiB; a block's weights 0.5 GiB
    prof = profile(blocks, param_bytes=2**30, grad_bytes=2**30, optimizer_state_bytes=2**31, optimizer_name="AdamW")
    with pytest.raises(ValueError) as info:
        plan(prof, budget=3 * 2**30)
    # n ranks: 4 GiB / n + 2 x (0.5 + 0.5) GiB <= 3 GiB  ->  n >= 4 (2 counting the shards alone)
    assert "ZeRO-3 / FSDP: fits from 4 data-parallel ranks (3.00 GiB per rank)" in str(info.value)


def test_fixed_part_floor():
    # model state fits (2 MiB) but the head's backward needs 2 + 10 MiB before any block.
    prof = chain(2, input_bytes=MIB, saved_bytes=4 * MIB, param_bytes=MIB, grad_bytes=MIB,
                 fixed_post_bwd_temp_bytes=10 * MIB)
    with pytest.raises(ValueError, match=r"below the minimum feasible peak, at least 11.00 MiB .* head's backward"):
        plan(prof, budget=8 * MIB)


def test_least_peak_and_where_it_falls():
    # 3 blocks (input 1 MiB, working 6 + 2 MiB), params 1 MiB, grads 1 MiB. Least peak: nest
    # [0,3) > [0,2) > [0,1), so only block 0's input is held while any block works:
    # 1 + 1 + 1 + 8 = 11 MiB (recomputing each block alone would hold 2 inputs at block 2: 12).
    blocks = [block(i, input_bytes=MIB, saved_bytes=6 * MIB, bwd_temp_bytes=2 * MIB) for i in range(3)]
    prof = profile(blocks, param_bytes=MIB, grad_bytes=MIB)
    assert plan(prof, budget=11 * MIB).prediction.peak_bytes == 11 * MIB
    # fastest at that peak: [0,2) > [0,1) and block 2 kept (it is last: nothing runs after it)
    assert plan(prof, budget=11 * MIB).prediction.extra_ms == 2 + 1
    with pytest.raises(ValueError, match=r"minimum feasible peak .* is 11.00 MiB \(11534336 bytes\), taken by the "
                                         r"backward of block 2 .* working set 8.00 MiB"):
        plan(prof, budget=11 * MIB - 1)


def test_budget_text_and_types():
    prof = chain(2, input_bytes=MIB, saved_bytes=4 * MIB)
    assert plan(prof, budget="100%", strategy="none").budget_bytes == 8 * MIB  # 4 + 4 held at the head
    assert plan(prof, budget="6MiB").prediction.peak_bytes <= 6 * MIB
    with pytest.raises(TypeError, match="budget 1.5 is not a positive whole number of bytes"):
        plan(prof, budget=1.5)
    assert plan(prof, budget=float(6 * MIB)).budget_bytes == 6 * MIB  # a whole float is bytes
    with pytest.raises(TypeError, match="positive int of bytes"):
        plan(prof, budget=True)
    with pytest.raises(ValueError, match="no blocks"):
        plan(profile([]))


def test_the_strategies_searched_include_offload_where_the_profile_can_price_it():
    """With the disk's rates measured the search offers offload:disk, and an infeasible budget's
    message listed the strategies without it."""
    from remat.measure.types import Bandwidths

    measured = chain(3, input_bytes=MIB, saved_bytes=4 * MIB,
                     bandwidths=Bandwidths(disk_write_bytes_per_s=1e9, disk_read_bytes_per_s=2e9, disk_dir="/tmp"))
    with pytest.raises(ValueError, match=r"minimum feasible peak with keep, recompute, nested segments and selective "
                                         r"policies, offload:disk is"):
        plan(measured, budget=MIB)
    with pytest.raises(ValueError, match=r"nested segments and selective policies is"):
        plan(chain(3, input_bytes=MIB, saved_bytes=4 * MIB), budget=MIB)
