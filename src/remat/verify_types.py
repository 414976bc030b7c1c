"""The Verification: what `remat.verify` measured for one plan against its baseline."""

from __future__ import annotations

from dataclasses import dataclass

from remat._serialize import JsonDocument, Rules
from remat.measure.types import MemoryEvent

VERIFICATION_FORMAT = "verification"
VERIFICATION_VERSION = 1
VERIFICATION_RULES = Rules(
    signed=frozenset({"peak_error_pct", "step_error_pct", "overhead_pct", "predicted_overhead_pct",
                      "paired_step_error_pct", "baseline_drift_pct", "compiled_peak_error_pct"}),
    finite=False,
)
"""Beyond the type hints: errors in percent are signed, and differences may be infinite (counts,
shapes or presence differ, or a run holds NaN or Inf)."""


@dataclass(kw_only=True, frozen=True)
class OpCount:
    """How often one aten op ran in one block: baseline step, planned step, and what the plan says."""

    block: str
    """Block name."""
    op: str
    """aten overload name."""
    baseline_count: int
    """Calls in the baseline step (forward + backward)."""
    planned_count: int
    """Calls in the planned step."""
    expected_count: int
    """Calls the plan predicts (baseline + planned recomputation)."""


@dataclass(kw_only=True, frozen=True)
class Verification(JsonDocument):
    """Baseline against planned step from the same weights and RNG seed."""

    DOCUMENT = (VERIFICATION_FORMAT, VERIFICATION_VERSION, VERIFICATION_RULES)

    strategy_name: str
    """The plan's planner name."""
    budget_bytes: int | None
    """The plan's budget."""
    loss_max_abs_diff: float
    """|loss_planned - loss_baseline|."""
    output_max_abs_diff: float
    """Max absolute difference of the model outputs (floating tensors)."""
    grad_max_abs_diff: float
    """Max absolute difference over every parameter gradient."""
    grads_identical: bool
    """True when loss, outputs and every gradient are bit-identical (and finite)."""
    nonfinite: tuple[str, ...] = ()
    """One line per loss, output or parameter gradient holding NaN or Inf, in either run (which
    run, which tensor, how many values): any of them makes the runs differ (`ok` is False)."""
    tolerance: float
    """Allowed max abs difference (0.0 on CPU: bit-identical), with `tolerance_reason`."""
    tolerance_reason: str
    """Why the tolerance is what it is."""
    head: str = "keep"
    """The plan's head strategy (`remat.plan.types.Plan.head`)."""
    relative_tolerance: float = 0.0
    """Normwise relative difference allowed on the loss and on each gradient,
    ``max|planned - baseline| <= relative_tolerance * max|baseline|`` (0.0: not used; a chunked
    head's: `remat.apply.head.head_tolerance`)."""
    grad_max_rel_diff: float = 0.0
    """Largest normwise relative difference over the loss and every parameter gradient."""
    baseline_peak_bytes: int
    """Measured peak of the baseline step."""
    measured_peak_bytes: int
    """Measured peak of the planned step (live-storage tracker)."""
    predicted_peak_bytes: int
    """The plan's predicted peak."""
    peak_error_pct: float
    """100 * (measured - predicted) / predicted."""
    device_max_allocated_bytes: int | None
    """torch.cuda.max_memory_allocated of the planned step (CUDA only)."""
    baseline_step_ms: float
    """Median measured baseline step time."""
    measured_step_ms: float
    """Median measured planned step time."""
    predicted_step_ms: float
    """The plan's predicted step time."""
    step_error_pct: float
    """100 * (measured - predicted) / predicted: absolute, so it includes the machine's change of
    speed between profiling and this run (`baseline_drift_pct`)."""
    overhead_pct: float
    """100 * (measured_step_ms / baseline_step_ms - 1)."""
    predicted_baseline_step_ms: float = 0.0
    """The profile's prediction of the step without recomputation (0: not recorded)."""
    predicted_overhead_pct: float = 0.0
    """100 * (predicted_step_ms / predicted_baseline_step_ms - 1)."""
    paired_step_error_pct: float = 0.0
    """The time model's error: measured planned step against the prediction at this run's
    speed, ``baseline_step_ms * predicted_step_ms / predicted_baseline_step_ms`` (both steps
    timed side by side, so a machine that got slower or faster since profiling cancels out)."""
    baseline_fault_bytes: int = 0
    """Host memory the baseline's timed steps faulted in fresh (median; 0 on CUDA)."""
    measured_fault_bytes: int = 0
    """Host memory the planned timed steps faulted in fresh (median; 0 on CUDA)."""
    predicted_fault_bytes: int = 0
    """What the plan's prediction says it faults in (`remat.plan.predict.fresh_memory`)."""
    baseline_drift_pct: float = 0.0
    """100 * (baseline_step_ms / predicted_baseline_step_ms - 1): how the machine's speed moved
    since profiling (load on a shared machine, clocks); the step time model is not in it."""
    op_counts: tuple[OpCount, ...]
    """Per block and op: baseline, planned and expected call counts."""
    recompute_counts_match: bool
    """True when every planned count equals the expected count."""
    compiled_backend: str = ""
    """The plan's (`remat.plan.types.Plan.compiled_backend`); "" for an eager plan. The fields
    above compare the steps run eagerly; for a compiled plan verify then runs both compiled with
    that backend, and the ``compiled_*`` fields say what they measured."""
    compiled_baseline_peak_bytes: int = 0
    """Peak of the baseline step compiled: the allocator's (it sees inside compiled kernels, the
    live tracker does not), counted from the same state as ``baseline_peak_bytes`` (0: not run)."""
    compiled_peak_bytes: int = 0
    """Peak of the planned step compiled, likewise (0: not run)."""
    compiled_peak_error_pct: float = 0.0
    """100 * (compiled_peak_bytes - predicted) / predicted: the error of a compiled plan's prediction."""
    compiled_baseline_step_ms: float = 0.0
    """Median time of the baseline step compiled."""
    compiled_step_ms: float = 0.0
    """Median time of the planned step compiled."""
    compiled_error: str = ""
    """Why the steps could not run compiled ("" when they did, or the plan is eager)."""
    timeline: tuple[MemoryEvent, ...] = ()
    """Live bytes over the planned step, for the timeline plot."""

    @property
    def ok(self) -> bool:
        """Gradients within the tolerance: bit-identical (CPU) or within `tolerance`, or under a
        chunked head within `relative_tolerance`. Never with a NaN or Inf in either run."""
        if self.nonfinite:
            return False
        if self.grads_identical or self.grad_max_abs_diff <= self.tolerance:
            return True
        return self.relative_tolerance > 0 and self.grad_max_rel_diff <= self.relative_tolerance

