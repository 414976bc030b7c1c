"""Wall-clock timing of a training step and of its blocks.

`Clock` reads ``time.perf_counter`` on the CPU and records CUDA events on CUDA (read after
a synchronize). `StepTimer` listens to the step's boundaries (`remat.measure.boundaries`)
and turns one step's marks into durations; `median_times` reduces several steps to medians.

A block's forward is ``fwd_end - fwd_start``; its backward runs from the gradient of its
output to the gradient of its inputs (``bwd_start``..``bwd_end``; a block without inputs
that need gradients ends where the backward pass ends). The fixed part is the rest of the
forward (from the call of the model to the loss) and of the backward (``loss.backward()``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from remat.measure.boundaries import Boundary

STEP_MARKS = ("step_start", "fwd_begin", "loss_ready", "bwd_begin", "bwd_done", "opt_start", "opt_end", "step_end")
"""The driver's own marks (emitted by `remat.measure.profile`) plus the optimizer's."""


class Clock:
    """Timestamps on the device's own clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return 1e3 * (end - start)
        end.synchronize()
        return float(start.elapsed_time(end))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass(kw_only=True, frozen=True)
class StepTimes:
    """Durations of one step (or medians over several), milliseconds."""

    block_fwd_ms: tuple[float, ...]
    block_bwd_ms: tuple[float, ...]
    fixed_fwd_ms: float
    fixed_bwd_ms: float
    optimizer_step_ms: float
    step_ms: float
    fault_bytes: int = 0
    """Host memory faulted in fresh during the step (`remat.measure.faults`; 0 when not counted;
    over several steps, the least: `steady_fault_bytes`)."""


class StepTimer:
    """Boundary listener: records a mark at every event of one step."""

    def __init__(self, clock: Clock, num_blocks: int) -> None:
        self.clock = clock
        self.num_blocks = num_blocks
        self.marks: dict[tuple[str, int], Any] = {}

    def __call__(self, event: Boundary) -> None:
        self.marks.setdefault((event.kind, event.index), self.clock.mark())

    def times(self) -> StepTimes:
        """Durations of the recorded step."""
        span = self._span
        fwd = [span(("fwd_start", i), ("fwd_end", i)) for i in range(self.num_blocks)]
        bwd = [span(("bwd_start", i), ("bwd_end", i), ("bwd_done", -1)) for i in range(self.num_blocks)]
        # the parts cover the whole step: the fixed forward from the step's start (zero_grad
        # included) to the loss, the fixed backward from there to the end of the backward pass,
        # the optimizer from there to the step's end (the backward's, without an optimizer)
        total_fwd = span(("step_start", -1), ("loss_ready", -1))
        total_bwd = span(("loss_ready", -1), ("bwd_done", -1))
        tail = span(("bwd_done", -1), ("step_end", -1))
        stepped = ("opt_start", -1) in self.marks
        return StepTimes(
            block_fwd_ms=tuple(fwd), block_bwd_ms=tuple(bwd),
            fixed_fwd_ms=max(total_fwd - sum(fwd), 0.0),
            fixed_bwd_ms=max(total_bwd - sum(bwd) + (0.0 if stepped else tail), 0.0),
            optimizer_step_ms=tail if stepped else 0.0, step_ms=span(("step_start", -1), ("step_end", -1)),
        )

    def _span(self, start: tuple[str, int], end: tuple[str, int], fallback: tuple[str, int] | None = None) -> float:
        if start not in self.marks:
            return 0.0
        stop = self.marks.get(end, self.marks.get(fallback)) if fallback else self.marks.get(end)
        return 0.0 if stop is None else self.clock.elapsed_ms(self.marks[start], stop)


def without_instrumentation(times: StepTimes, plain_step_ms: float) -> StepTimes:
    """``times`` (an instrumented step's) scaled to a plain step's length ``plain_step_ms``.

    The hooks that mark the boundaries cost time of their own (on the built-in MLP's 8 small
    blocks 1 ms of a 9 ms step, 10 %), time a trained model never spends: every part is scaled
    by the plain step's share of the instrumented one (never up: hooks only add), on the
    assumption that the hooks' cost falls on the parts as their time does."""
    if times.step_ms <= 0 or plain_step_ms <= 0:
        return times
    scale = min(plain_step_ms / times.step_ms, 1.0)
    return dataclasses.replace(
        times, block_fwd_ms=tuple(scale * t for t in times.block_fwd_ms),
        block_bwd_ms=tuple(scale * t for t in times.block_bwd_ms), fixed_fwd_ms=scale * times.fixed_fwd_ms,
        fixed_bwd_ms=scale * times.fixed_bwd_ms, optimizer_step_ms=scale * times.optimizer_step_ms,
        step_ms=scale * times.step_ms,
    )


def median_times(steps: Sequence[StepTimes]) -> StepTimes:
    """Element-wise medians of several steps; of the fresh memory they faulted in, the least
    (`steady_fault_bytes`)."""
    med = statistics.median
    return StepTimes(
        block_fwd_ms=tuple(med(col) for col in zip(*(s.block_fwd_ms for s in steps))),
        block_bwd_ms=tuple(med(col) for col in zip(*(s.block_bwd_ms for s in steps))),
        fixed_fwd_ms=med(s.fixed_fwd_ms for s in steps), fixed_bwd_ms=med(s.fixed_bwd_ms for s in steps),
        optimizer_step_ms=med(s.optimizer_step_ms for s in steps), step_ms=med(s.step_ms for s in steps),
        fault_bytes=steady_fault_bytes([s.fault_bytes for s in steps]),
    )


def steady_fault_bytes(faulted: Sequence[int]) -> int:
    """What a step faults in once the host allocator has settled: the least any of the timed
    steps ``faulted`` (0 for none).

    A profile's first steps fault in more than the steps of a training loop that follows, and
    each by a different amount: glibc raises its mmap and trim thresholds as it frees larger
    blocks, and returns the top of its heap to the kernel or not depending on what sits above
    it, so the fresh memory a step needs is set by the allocator's state as much as by the step
    (`remat.measure.faults`); the settling only adds faults. The built-in ConvNet in stages
    (13.4 MiB peak, 2026-12-06): the five timed steps of one profile faulted in 8.0, 5.8, 12.8,
    9.9 and 4.1 MiB, of another 3.6, 0.6, 3.4, 4.0 and 0 (medians 8.0 and 3.4), where the same
    steps timed beside other plans afterwards (`benchmarks.peers`) faulted in 0.36 MiB on average
    and loops of its steps alone 0 to 4.6 (medians of four loops). A recomputing plan's lower
    peak was credited as faults avoided (`remat.plan.predict.fresh_memory`: up to 1.9 ms) that
    its steps did not show: two units recomputed measured 5.76 ms of CPU time over the step
    without recomputation, predicted 4.73 with the median (0.47 ms of credit, the mean over
    four profiles) and 5.20 with the least. On the built-in GPT (149 MiB peak) the five faulted
    in 91, 48, 48, 56 and 56 MiB and a loop of its steps 44 MiB (median of ten): there the least
    is close to what the loop faults in too."""
    return int(min(faulted, default=0))
