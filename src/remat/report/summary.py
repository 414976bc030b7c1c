"""The report's answer in one sentence: which plan fits, at what time cost, saving how much.

Definitions used in every figure and table of the report:
- the **baseline** is no recomputation: the prediction of a plan named ``none`` when one is
  given, else the profile's own measured baseline step;
- the **budget** is the one passed in, else the tightest budget among the plans;
- the **chosen plan** is the fastest plan whose predicted peak fits the budget (ties: the
  smaller peak, then a plan made for a budget); with no budget, the plan with the smallest
  predicted peak;
- **activation memory** is peak minus model state (parameters, gradients, optimizer state,
  buffers): everything the step's activations, fixed part and temporaries add on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.report.units import format_bytes, format_pct, format_ratio
from remat.verify_types import Verification

BASELINE_STRATEGY = "none"


@dataclass(kw_only=True, frozen=True)
class StepPoint:
    """Peak memory and time of one training step (predicted or measured)."""

    label: str
    """What the point is, e.g. ``"optimal @ 4.0 GiB"``."""
    peak_bytes: int
    """Peak live bytes."""
    step_ms: float
    """Step time."""
    model_state_bytes: int
    """Parameters + gradients + optimizer state + buffers at the peak."""
    fixed_bytes: int
    """Saved bytes of the fixed part at the peak."""
    measured: bool
    """True for a measurement, False for a prediction."""

    @property
    def activation_bytes(self) -> int:
        return max(self.peak_bytes - self.model_state_bytes, 0)


def plan_label(plan: Plan) -> str:
    """``"optimal @ 4.0 GiB"``, or the strategy name alone without a budget; a head strategy
    other than keep follows (``", head chunked:1024"``)."""
    head = "" if plan.head == "keep" else f", head {plan.head}"
    if plan.budget_bytes is None:
        return plan.strategy_name + head
    return f"{plan.strategy_name} @ {format_bytes(plan.budget_bytes)}{head}"


def plan_point(plan: Plan) -> StepPoint:
    """The plan's predicted step."""
    pred = plan.prediction
    return StepPoint(label=plan_label(plan), peak_bytes=pred.peak_bytes, step_ms=pred.step_ms,
                     model_state_bytes=pred.model_state_bytes, fixed_bytes=pred.fixed_bytes,
                     measured=False)


def baseline_point(profile: Profile, plans: Sequence[Plan] = ()) -> StepPoint:
    """No recomputation: the ``none`` plan's prediction, else the profile's measured step."""
    for plan in plans:
        if plan.strategy_name == BASELINE_STRATEGY:
            return plan_point(plan)
    return StepPoint(label="no recomputation (measured)", peak_bytes=profile.peak_bytes,
                     step_ms=profile.step_ms, model_state_bytes=profile.model_state_bytes,
                     fixed_bytes=profile.fixed_saved_bytes, measured=True)


def report_budget(plans: Sequence[Plan], budget_bytes: int | None = None) -> int | None:
    """The explicit budget, else the tightest budget among ``plans`` (None when none has one)."""
    if budget_bytes is not None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}; pass e.g. 4 * 2**30.")
        return budget_bytes
    budgets = [p.budget_bytes for p in plans if p.budget_bytes is not None]
    return min(budgets) if budgets else None


def choose_plan(plans: Sequence[Plan], budget_bytes: int | None) -> Plan | None:
    """The fastest plan that fits ``budget_bytes``; the lowest-peak plan without a budget."""
    if not plans:
        return None
    if budget_bytes is None:
        return min(plans, key=lambda p: (p.prediction.peak_bytes, p.prediction.step_ms))
    fitting = [p for p in plans if p.prediction.peak_bytes <= budget_bytes]
    if not fitting:
        return None
    # Ties go to a plan made for a budget: the one that was asked for.
    return min(fitting, key=lambda p: (p.prediction.step_ms, p.prediction.peak_bytes, p.budget_bytes is None))


def find_verification(plan: Plan, verifications: Sequence[Verification]) -> Verification | None:
    """The verification of ``plan`` (same planner name and budget), if any."""
    for ver in verifications:
        if ver.strategy_name == plan.strategy_name and ver.budget_bytes == plan.budget_bytes:
            return ver
    return None


def summary_sentence(profile: Profile, plans: Sequence[Plan] = (),
                     verifications: Sequence[Verification] = (), *,
                     budget_bytes: int | None = None) -> str:
    """The report's headline, e.g. "The optimal plan fits 4.0 GiB at +9% step time, 3.1x less
    activation memory than no recomputation." (plus what verification measured)."""
    budget = report_budget(plans, budget_bytes)
    base = baseline_point(profile, plans)
    chosen = choose_plan(plans, budget)
    if not plans:
        text = (f"No plan given: without recomputation the step peaks at {format_bytes(base.peak_bytes)}"
                f" and takes {base.step_ms:.1f} ms; run `remat plan` to compare strategies.")
    elif chosen is None:
        text = _nothing_fits(plans, budget, base)
    elif chosen.strategy_name == BASELINE_STRATEGY:
        text = (f"No recomputation already fits {format_bytes(budget)} "
                f"(predicted peak {format_bytes(chosen.prediction.peak_bytes)}): nothing to recompute.")
    else:
        text = _fits(chosen, budget, base)
    ver = find_verification(chosen, verifications) if chosen is not None else None
    return text if ver is None else f"{text} {_measured(ver, budget)}"


def _fits(plan: Plan, budget: int | None, base: StepPoint) -> str:
    point = plan_point(plan)
    overhead = 100.0 * (point.step_ms / base.step_ms - 1.0) if base.step_ms > 0 else 0.0
    ratio = base.activation_bytes / point.activation_bytes if point.activation_bytes else float("inf")
    where = (f"fits {format_bytes(budget)}" if budget is not None
             else f"peaks at {format_bytes(point.peak_bytes)}")
    saving = (f"{format_ratio(ratio)} less" if ratio >= 1 else f"{format_ratio(1 / ratio)} more")
    return (f"The {plan.strategy_name} plan {where} at {format_pct(overhead)} step time, "
            f"{saving} activation memory than no recomputation "
            f"(predicted peak {format_bytes(point.peak_bytes)} vs {format_bytes(base.peak_bytes)}).")


def _nothing_fits(plans: Sequence[Plan], budget: int, base: StepPoint) -> str:
    smallest = min(plans, key=lambda p: p.prediction.peak_bytes)
    return (f"No plan fits {format_bytes(budget)}: the smallest, {smallest.strategy_name}, peaks at "
            f"{format_bytes(smallest.prediction.peak_bytes)}; model state alone is "
            f"{format_bytes(smallest.prediction.model_state_bytes)}, so shard or shrink it "
            "(fewer optimizer states, lower precision, a smaller batch).")


def _compiled_measured(ver: Verification, budget: int | None) -> str:
    """What verify measured of the compiled steps a compiled plan is for (`remat.verify_compiled`)."""
    if ver.compiled_error:
        return (f" The plan is for the model compiled with {ver.compiled_backend!r}, which did not run compiled "
                f"({ver.compiled_error}): the figures above are the eager steps'.")
    over = (f", over the {format_bytes(budget)} budget"
            if budget is not None and ver.compiled_peak_bytes > budget else "")
    overhead = 100.0 * (ver.compiled_step_ms / ver.compiled_baseline_step_ms - 1.0) if ver.compiled_baseline_step_ms else 0.0
    return (f" The plan is for the model compiled with {ver.compiled_backend!r}; the figures above are the eager "
            f"steps'. Compiled: peak {format_bytes(ver.compiled_peak_bytes)} ({format_pct(ver.compiled_peak_error_pct)} "
            f"vs predicted{over}; the allocator's), step {ver.compiled_step_ms:.1f} ms ({format_pct(overhead)} vs the "
            "baseline compiled).")


def _measured(ver: Verification, budget: int | None) -> str:
    if ver.nonfinite:
        grads = f"gradients DIFFER: NaN or Inf in {len(ver.nonfinite)} tensor(s), first: {ver.nonfinite[0]}"
    elif ver.grads_identical:
        grads = "gradients bit-identical"
    elif ver.ok and ver.relative_tolerance:
        grads = (f"gradients within the head's relative tolerance (max {ver.grad_max_rel_diff:.1e} <= "
                 f"{ver.relative_tolerance:.1e})")
    elif ver.ok:
        grads = f"gradients within tolerance (max difference {ver.grad_max_abs_diff:.1e} <= {ver.tolerance:.1e})"
    else:
        grads = f"gradients DIFFER (max difference {ver.grad_max_abs_diff:.1e} > tolerance {ver.tolerance:.1e})"
    over = (f", over the {format_bytes(budget)} budget"
            if budget is not None and ver.measured_peak_bytes > budget else "")
    eager = _compiled_measured(ver, budget) if ver.compiled_backend else ""
    return (f"Measured: peak {format_bytes(ver.measured_peak_bytes)} "
            f"({format_pct(ver.peak_error_pct)} vs predicted{over}), step {ver.measured_step_ms:.1f} ms "
            f"({format_pct(ver.overhead_pct)} vs baseline), {grads}.{eager}")
