"""Samples for the report tests: a small, hand-written profile of a 4-block model and plans / verifications made on it.

Every number is chosen to be checked by hand (MiB = 2**20 bytes):
model state 16 + 16 + 32 = 64 MiB; each block saves 8 MiB and takes 1 MiB of input;
the fixed part saves 1 MiB before the blocks and 2 MiB after them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remat.measure.types import (
    Bandwidths,
    BlockProfile,
    Environment,
    Fingerprint,
    MemoryEvent,
    OpRecord,
    Profile,
)
from remat.plan.types import Plan, Prediction, Segment
from remat.verify_types import OpCount, Verification

MIB = 2**20
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "report"
COMMANDS = ("remat run --model gpt --budget 80MiB", "remat report profile.json plan.json -o report.html")
NUM_BLOCKS = 4
BLOCK_NAMES = tuple(f"blocks.{i}" for i in range(NUM_BLOCKS))
FINGERPRINT = Fingerprint(model_hash="c0ffee12", batch_shapes=("4x128:int64",), device="cpu",
                          dtype="float32", torch_version="2.13.0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_block(i: int) -> BlockProfile:
    ops = (
        OpRecord(key="aten.mm.default#0", name="aten.mm.default", output_bytes=4 * MIB,
                 saved_bytes=4 * MIB, time_ms=1.0, flops=2_000_000_000, is_random=False, is_view=False),
        OpRecord(key="aten.gelu.default#0", name="aten.gelu.default", output_bytes=4 * MIB,
                 saved_bytes=4 * MIB, time_ms=0.5, flops=0, is_random=False, is_view=False),
    )
    return BlockProfile(index=i, name=BLOCK_NAMES[i], class_name="Block", input_bytes=1 * MIB,
                        output_bytes=1 * MIB, saved_bytes=8 * MIB, bwd_temp_bytes=2 * MIB,
                        fwd_ms=2.0, bwd_ms=4.0, fwd_flops=2_000_000_000, ops=ops)


def make_timeline(block_mib: float) -> tuple[MemoryEvent, ...]:
    """Forward grows by ``block_mib`` per block, backward frees it in reverse."""
    state = 64 * MIB
    events = [MemoryEvent(phase="fwd", where="pre", live_bytes=state + 1 * MIB)]
    live = state + 1 * MIB
    for name in BLOCK_NAMES:
        live += int(block_mib * MIB)
        events.append(MemoryEvent(phase="fwd", where=name, live_bytes=live))
    events.append(MemoryEvent(phase="fwd", where="post", live_bytes=live + 2 * MIB))
    events.append(MemoryEvent(phase="bwd", where="post", live_bytes=live + 4 * MIB))
    for name in reversed(BLOCK_NAMES):
        events.append(MemoryEvent(phase="bwd", where=name, live_bytes=live + 2 * MIB))
        live -= int(block_mib * MIB)
    events.append(MemoryEvent(phase="bwd", where="pre", live_bytes=live))
    events.append(MemoryEvent(phase="opt", where="optimizer", live_bytes=state + 8 * MIB))
    return tuple(events)


def make_profile(*, timeline: bool = True) -> Profile:
    return Profile(
        fingerprint=FINGERPRINT,
        environment=Environment(device_name="Test CPU 3000", num_threads=2,
                                python_version="3.11.9", hostname="bench-host"),
        blocks=tuple(make_block(i) for i in range(NUM_BLOCKS)),
        param_bytes=16 * MIB, grad_bytes=16 * MIB, optimizer_state_bytes=32 * MIB,
        optimizer_name="AdamW", optimizer_step_temp_bytes=8 * MIB, optimizer_step_ms=1.5,
        buffer_bytes=0, fixed_pre_saved_bytes=1 * MIB, fixed_post_saved_bytes=2 * MIB,
        fixed_post_bwd_temp_bytes=2 * MIB, fixed_fwd_ms=3.0, fixed_bwd_ms=4.0,
        fixed_flops=500_000_000, step_ms=30.5, peak_bytes=101 * MIB,
        peak_bytes_by_category={"parameters": 16 * MIB, "gradients": 16 * MIB,
                                "optimizer_state": 32 * MIB, "activations": 35 * MIB,
                                "temporaries": 2 * MIB, "buffers": 0},
        device_max_allocated_bytes=None,
        timeline=make_timeline(8) if timeline else (),
        bandwidths=Bandwidths(disk_write_bytes_per_s=500 * MIB, disk_read_bytes_per_s=800 * MIB),
    )


def make_plan(strategy_name: str, segments: tuple[Segment, ...], *, peak_mib: int, step_ms: float,
              retained_mib: tuple[float, ...], budget_mib: int | None = None,
              extra_flops: int = 0, extra_ms: float = 0.0, offloaded_mib: int = 0) -> Plan:
    pred = Prediction(peak_bytes=peak_mib * MIB, step_ms=step_ms, extra_flops=extra_flops,
                      extra_ms=extra_ms, model_state_bytes=64 * MIB, fixed_bytes=3 * MIB,
                      retained_bytes=tuple(int(r * MIB) for r in retained_mib), peak_block=3,
                      peak_phase="block", working_bytes=10 * MIB, offloaded_bytes=offloaded_mib * MIB)
    return Plan(segments=segments, block_names=BLOCK_NAMES, strategy_name=strategy_name,
                budget_bytes=None if budget_mib is None else budget_mib * MIB,
                prediction=pred, fingerprint=FINGERPRINT)


def make_plans() -> dict[str, Plan]:
    """none (no recomputation), full (every block recomputed), optimal @ 80 MiB, offload."""
    return {
        "none": make_plan("none", (Segment(start=0, stop=4, strategy="keep"),),
                          peak_mib=100, step_ms=30.0, retained_mib=(8, 8, 8, 8)),
        "full": make_plan("full", tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(4)),
                          peak_mib=76, step_ms=38.0, retained_mib=(1, 1, 1, 1),
                          extra_flops=8_000_000_000, extra_ms=8.0),
        "optimal": make_plan("optimal", (Segment(start=0, stop=1, strategy="keep"),
                                         Segment(start=1, stop=4, strategy="recompute")),
                             peak_mib=79, step_ms=34.0, retained_mib=(8, 1, 0, 0), budget_mib=80,
                             extra_flops=6_000_000_000, extra_ms=4.0),
        "offload": make_plan("offload", (Segment(start=0, stop=2, strategy="offload:cpu"),
                                         Segment(start=2, stop=4, strategy="keep")),
                             peak_mib=90, step_ms=31.0, retained_mib=(0.5, 0.5, 8, 8),
                             offloaded_mib=16, extra_ms=1.0),
    }


def make_verification(*, timeline: bool = True) -> Verification:
    """The optimal plan verified: measured peak 81 MiB (predicted 79), step 35 ms (predicted 34, of
    which 29 the baseline; the baseline ran 30.5 ms beside it)."""
    return Verification(
        strategy_name="optimal", budget_bytes=80 * MIB, loss_max_abs_diff=0.0, output_max_abs_diff=0.0,
        grad_max_abs_diff=0.0, grads_identical=True, tolerance=0.0,
        tolerance_reason="CPU: deterministic kernels, bit-identical expected",
        baseline_peak_bytes=101 * MIB, measured_peak_bytes=81 * MIB, predicted_peak_bytes=79 * MIB,
        peak_error_pct=100 * (81 - 79) / 79, device_max_allocated_bytes=None,
        baseline_step_ms=30.5, measured_step_ms=35.0, predicted_step_ms=34.0,
        step_error_pct=100 * (35 - 34) / 34, overhead_pct=100 * (35 / 30.5 - 1),
        predicted_baseline_step_ms=29.0, predicted_overhead_pct=100 * (34 / 29 - 1),
        paired_step_error_pct=100 * (35 / (30.5 * 34 / 29) - 1), baseline_drift_pct=100 * (30.5 / 29 - 1),
        op_counts=(OpCount(block="blocks.1", op="aten.mm.default", baseline_count=3, planned_count=4,
                           expected_count=4),),
        recompute_counts_match=True,
        timeline=make_timeline(3) if timeline else (),
    )


@pytest.fixture
def profile() -> Profile:
    return make_profile()


@pytest.fixture
def plans() -> dict[str, Plan]:
    return make_plans()


@pytest.fixture
def verification() -> Verification:
    return make_verification()


@pytest.fixture(scope="session")
def sample_report() -> Path:
    """The full sample report (every section, four figures), written once under artifacts/report/."""
    from remat.report.html import write_report

    return write_report(ARTIFACTS / "report.html", make_profile(), list(make_plans().values()),
                        [make_verification()], commands=COMMANDS)
