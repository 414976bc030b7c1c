"""Offload in the planner: exact costs on a hand-made profile; offload chosen only where it pays."""

from __future__ import annotations

import pytest

from remat.apply.offload import MIN_BYTES as ENGINE_MIN_BYTES
from remat.measure.types import Bandwidths, BlockProfile, Environment, Fingerprint, OpRecord, Profile
from remat.plan.costs import cost_of
from remat.plan.offload_cost import MIN_BYTES, exposed_ms, offload_strategies, offloadable_bytes
from remat.plan.planners import plan
from remat.plan.predict import predict
from remat.plan.types import Segment

MiB = 1 << 20
SMALL = 16 << 10  # a 16 KiB saved tensor: under the threshold, it stays
SAVED = 4 * MiB + 8 * MiB + 4 * MiB + SMALL  # input + mm output + gelu output + a small one
MOVED = 16 * MiB
FAST = float(2 << 30)  # 2 GiB/s: 16 MiB in 7.8125 ms
SLOW = float(64 << 20)  # 64 MiB/s: 16 MiB in 250 ms


def _op(key: str, saved: int) -> OpRecord:
    return OpRecord(key=key, name=key.split("#")[0], output_bytes=saved, saved_bytes=saved, time_ms=1.0,
                    flops=10, is_random=False, is_view=False)


def _block(i: int) -> BlockProfile:
    ops = (_op("aten.mm.default#0", 8 * MiB), _op("aten.gelu.default#0", 4 * MiB), _op("aten.sum.default#0", SMALL))
    return BlockProfile(index=i, name=f"blocks.{i}", class_name="Toy", input_bytes=4 * MiB, output_bytes=4 * MiB,
                        saved_bytes=SAVED, bwd_temp_bytes=0, fwd_ms=10.0, bwd_ms=20.0, fwd_flops=1000, ops=ops)


def toy_profile(rate: float | None, overlap: float | None, device: str = "cpu", **bw) -> Profile:
    bandwidths = Bandwidths(disk_write_bytes_per_s=rate, disk_read_bytes_per_s=rate, disk_overlap_fraction=overlap, **bw)
    return Profile(
        fingerprint=Fingerprint(model_hash="toy", batch_shapes=(), device=device, dtype="float32", torch_version="x"),
        environment=Environment(device_name="toy", num_threads=1, python_version="3", hostname="toy"),
        blocks=tuple(_block(i) for i in range(4)), param_bytes=0, grad_bytes=0, optimizer_state_bytes=0,
        optimizer_name="none", optimizer_step_temp_bytes=0, optimizer_step_ms=0.0, buffer_bytes=0,
        fixed_pre_saved_bytes=0, fixed_post_saved_bytes=0, fixed_post_bwd_temp_bytes=0, fixed_fwd_ms=0.0,
        fixed_bwd_ms=0.0, fixed_flops=0, step_ms=120.0, peak_bytes=4 * SAVED, peak_bytes_by_category={},
        device_max_allocated_bytes=None, bandwidths=bandwidths,
    )


def test_threshold_matches_the_engine():
    assert MIN_BYTES == ENGINE_MIN_BYTES


def test_block_cost_exact():
    profile = toy_profile(FAST, 0.5)
    assert offloadable_bytes(profile.blocks[0]) == MOVED
    first = cost_of(profile, 0, Segment(start=0, stop=1, strategy="offload:disk"))
    later = cost_of(profile, 2, Segment(start=2, stop=3, strategy="offload:disk"))
    # transfer 7.8125 ms each way; half of min(transfer, compute) hidden: 3.90625 + 3.90625 exposed
    assert (first.retained_bytes, first.working_bytes, first.extra_ms, first.extra_flops, first.offloaded_bytes) == (
        SMALL, SAVED, 7.8125, 0, MOVED)
    assert later.working_bytes == SAVED + MOVED  # the previous block's bytes, prefetched
    assert exposed_ms(250.0, 10.0, 1.0) == 240.0


def test_predict_all_offload_exact():
    profile = toy_profile(FAST, 0.5)
    pred = predict(profile, (Segment(start=0, stop=4, strategy="offload:disk"),))
    assert pred.retained_bytes == (SMALL,) * 4
    assert pred.offloaded_bytes == 4 * MOVED
    assert pred.extra_ms == 4 * 7.8125 and pred.extra_flops == 0
    assert pred.peak_bytes == 3 * SMALL + SAVED + MOVED  # block 3's backward with block 2 prefetched


def test_unmeasured_overlap_hides_nothing():
    profile = toy_profile(FAST, None)
    cost = cost_of(profile, 1, Segment(start=1, stop=2, strategy="offload:disk"))
    assert cost.extra_ms == 2 * 7.8125


BUDGET = 40 * MiB  # keeping everything peaks at 4 * SAVED (~64 MiB)


def _kinds(result) -> set[str]:
    return set(result.block_strategies())


def test_planner_picks_offload_when_the_disk_is_fast():
    result = plan(toy_profile(FAST, 1.0), BUDGET, "optimal")
    assert "offload:disk" in _kinds(result)
    assert "recompute" not in _kinds(result)
    assert result.prediction.extra_ms == 0.0 and result.prediction.peak_bytes <= BUDGET


def test_planner_avoids_offload_when_the_disk_is_slow():
    result = plan(toy_profile(SLOW, 1.0), BUDGET, "optimal")
    assert "offload:disk" not in _kinds(result)
    assert "recompute" in _kinds(result) or any(k.startswith("selective") for k in _kinds(result))
    assert result.prediction.peak_bytes <= BUDGET


def test_no_disk_rates_no_offload():
    profile = toy_profile(None, None)
    assert offload_strategies(profile) == ()
    assert "offload:disk" not in _kinds(plan(profile, BUDGET, "optimal"))
    with pytest.raises(ValueError, match=r"cannot cost 'offload:disk': the profile has no measured rates"):
        cost_of(profile, 0, Segment(start=0, stop=1, strategy="offload:disk"))


def test_host_offload_not_offered_on_cpu():
    rates = dict(host_to_device_bytes_per_s=FAST, device_to_host_bytes_per_s=FAST, overlap_fraction=1.0)
    assert offload_strategies(toy_profile(None, None, "cpu", **rates)) == ()
    assert offload_strategies(toy_profile(FAST, 1.0, "cuda", **rates)) == ("offload:cpu", "offload:disk")
    assert "offload:cpu" not in _kinds(plan(toy_profile(None, None, "cpu", **rates), BUDGET, "optimal"))


def test_host_offload_chosen_on_a_gpu_profile():
    rates = dict(host_to_device_bytes_per_s=FAST, device_to_host_bytes_per_s=FAST, overlap_fraction=1.0)
    result = plan(toy_profile(None, None, "cuda", **rates), BUDGET, "optimal")
    assert "offload:cpu" in _kinds(result) and result.prediction.extra_ms == 0.0
