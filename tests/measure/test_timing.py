"""Step timing: the parts of an instrumented step and their scaling to a plain step."""

import pytest
import torch

from remat.measure.timing import Clock, StepTimer, StepTimes, median_times, steady_fault_bytes, without_instrumentation


def _timer(marks_s: dict[tuple[str, int], float], num_blocks: int = 2) -> StepTimer:
    timer = StepTimer(Clock(torch.device("cpu")), num_blocks)
    timer.marks.update(marks_s)
    return timer


MARKS = {  # seconds; two blocks, an optimizer
    ("step_start", -1): 0.000, ("fwd_begin", -1): 0.001, ("fwd_start", 0): 0.002, ("fwd_end", 0): 0.005,
    ("fwd_start", 1): 0.006, ("fwd_end", 1): 0.010, ("loss_ready", -1): 0.012, ("bwd_begin", -1): 0.012,
    ("bwd_start", 1): 0.013, ("bwd_end", 1): 0.019, ("bwd_start", 0): 0.019, ("bwd_end", 0): 0.024,
    ("bwd_done", -1): 0.025, ("opt_start", -1): 0.026, ("opt_end", -1): 0.029, ("step_end", -1): 0.030,
}


def test_the_parts_cover_the_whole_step():
    times = _timer(MARKS).times()
    assert times.block_fwd_ms == pytest.approx((3.0, 4.0))
    assert times.block_bwd_ms == pytest.approx((5.0, 6.0))
    # fixed forward: from the step's start (zero_grad) to the loss, less the blocks: 12 - 7
    assert times.fixed_fwd_ms == pytest.approx(5.0)
    # fixed backward: from the loss to the end of the backward pass, less the blocks: 13 - 11
    assert times.fixed_bwd_ms == pytest.approx(2.0)
    assert times.optimizer_step_ms == pytest.approx(5.0)  # from the backward's end to the step's
    assert times.step_ms == pytest.approx(30.0)


def test_without_an_optimizer_the_tail_is_the_backwards():
    marks = {k: v for k, v in MARKS.items() if k[0] not in ("opt_start", "opt_end")}
    times = _timer(marks).times()
    assert times.optimizer_step_ms == 0.0
    assert times.fixed_bwd_ms == pytest.approx(7.0)


def test_scaled_to_the_plain_step():
    times = _timer(MARKS).times()
    plain = without_instrumentation(times, 24.0)
    assert plain.step_ms == pytest.approx(24.0)
    assert plain.block_fwd_ms == pytest.approx((2.4, 3.2))
    assert plain.block_bwd_ms == pytest.approx((4.0, 4.8))
    assert (plain.fixed_fwd_ms, plain.fixed_bwd_ms, plain.optimizer_step_ms) == pytest.approx((4.0, 1.6, 4.0))
    # hooks only add time: a plain step measured slower (noise) scales nothing up
    assert without_instrumentation(times, 45.0) == times
    empty = StepTimes(block_fwd_ms=(), block_bwd_ms=(), fixed_fwd_ms=0.0, fixed_bwd_ms=0.0,
                      optimizer_step_ms=0.0, step_ms=0.0)
    assert without_instrumentation(empty, 5.0) == empty


def _step(ms: float, fault_mib: float) -> StepTimes:
    return StepTimes(block_fwd_ms=(ms, 2 * ms), block_bwd_ms=(3 * ms, ms), fixed_fwd_ms=ms, fixed_bwd_ms=ms,
                     optimizer_step_ms=0.0, step_ms=8 * ms, fault_bytes=int(fault_mib * 2**20))


def test_the_steps_fault_in_the_least_any_of_them_did_and_take_their_median_times():
    # a ConvNet's profile: its five timed steps faulted in 8.0, 5.8, 12.8, 9.9 and 4.1 MiB while
    # the allocator settled; the median (8.0) credited its recomputing plans with faults their
    # steps never had
    times = median_times([_step(1.0, 8.0), _step(3.0, 5.75), _step(2.0, 12.75), _step(4.0, 9.875), _step(5.0, 4.125)])
    assert times.fault_bytes == int(4.125 * 2**20)
    assert times.block_fwd_ms == (3.0, 6.0) and times.block_bwd_ms == (9.0, 3.0) and times.step_ms == 24.0
    assert median_times([_step(1.0, 3.625), _step(1.0, 0.0), _step(1.0, 3.4375)]).fault_bytes == 0
    assert steady_fault_bytes([3, 1, 2]) == 1 and steady_fault_bytes([]) == 0
