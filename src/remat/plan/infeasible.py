"""Errors for budgets no plan can meet: they state the minimum feasible peak and what takes it."""

from __future__ import annotations

from remat.measure.types import Profile
from remat.memory.diagnose import explain_model_state_overflow
from remat.memory.model_state import ModelState
from remat.plan.budget import format_bytes
from remat.plan.types import Prediction

__all__ = ["check_state_fits", "infeasible_error"]


def check_state_fits(profile: Profile, budget_bytes: int, floor_bytes: int, floor_name: str) -> None:
    """Raise when memory that no plan changes (model state, the fixed part) exceeds the budget.

    ``floor_bytes`` is the plan-independent part of the peak named by ``floor_name``."""
    overflow = explain_model_state_overflow(
        param_bytes=profile.param_bytes,
        grad_bytes=profile.gradient_bytes,
        optimizer_state_bytes=profile.optimizer_state_bytes,
        buffer_bytes=profile.buffer_bytes,
        budget_bytes=budget_bytes,
        optimizer_name=profile.optimizer_name,
        largest_unit=largest_block(profile),
    )
    if overflow:
        raise ValueError(overflow)
    if floor_bytes > budget_bytes:
        raise ValueError(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is below the minimum feasible peak, "
            f"at least {format_bytes(floor_bytes)} ({floor_bytes} bytes) for {floor_name}, which no "
            "recomputation plan changes: "
            f"model state {format_bytes(profile.model_state_bytes)}. Raise the budget to at least "
            f"{floor_bytes}B or shrink model state (ZeRO/FSDP sharding, 8-bit optimizer state, "
            "optimizer offload)."
        )


def largest_block(profile: Profile) -> ModelState | None:
    """What ZeRO-3 would gather as its largest unit, one block per unit: the block's weights and
    gradients, at the bytes of its gradients (None without blocks)."""
    largest = max((b.grad_bytes for b in profile.blocks), default=0)
    return ModelState(param_bytes=largest, grad_bytes=largest, master_bytes=0, optimizer_state_bytes=0) if largest else None


def infeasible_error(budget_bytes: int, best: Prediction, what: str) -> ValueError:
    """Error for a budget below the least peak ``best`` of the plans ``what`` could make."""
    return ValueError(
        f"no plan fits the budget {format_bytes(budget_bytes)} ({budget_bytes} bytes): the minimum "
        f"feasible peak with {what} is {format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes), "
        f"taken by {_breakdown(best)}. Raise the budget to at least {best.peak_bytes}B, or "
        "shrink the batch or sequence length."
    )


def _breakdown(pred: Prediction) -> str:
    """What makes up the peak of ``pred``."""
    state = f"model state {format_bytes(pred.model_state_bytes)}"
    fixed = f"fixed part {format_bytes(pred.fixed_bytes)}"
    if pred.peak_phase == "optimizer":
        return f"the optimizer step ({state} plus its temporaries)"
    if pred.peak_phase == "pre-forward":
        return "the forward before the first block (model state without gradients, and its own peak)"
    if pred.peak_phase == "pre-backward":
        return (f"the backward of the part before the first block ({state}, gradients, {fixed} saved by it, "
                "and its own peak), after every block's: no plan changes it")
    held = format_bytes(sum(pred.retained_bytes[: max(pred.peak_block, 0)]))
    if pred.peak_phase == "block":
        return (
            f"the backward of block {pred.peak_block} ({state}, {fixed}, {held} held by earlier "
            f"blocks, working set {format_bytes(pred.working_bytes)})"
        )
    total = format_bytes(sum(pred.retained_bytes))
    return f"the head's backward ({state}, {fixed} incl. the head, {total} held by the blocks)"
