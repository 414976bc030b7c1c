"""The whole step's memory at its peak, by category: why a step may still not fit.

One horizontal stacked bar per step (the baseline, then each plan), split into

- parameters (with buffers), gradients, optimizer state: the model state, from the profile;
- fixed part: saved bytes of everything outside blocks (embedding, head, loss) at the peak;
- activations: the rest of the peak (blocks' retained and working bytes, temporaries).

Plans' bars split their predicted peak; the measured baseline's bar (when no ``none`` plan is
given) uses the live-memory tracker's categories at the measured peak instead. When
parameters, gradients and optimizer state alone pass the budget, no recomputation plan can
fit: the bar shows it at a glance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.report.style import BUDGET_COLOR, BUDGET_LINESTYLE, CATEGORY_STYLE, new_figure, style_axes
from remat.report.summary import BASELINE_STRATEGY, StepPoint, baseline_point, plan_point, report_budget
from remat.report.units import byte_scale, format_bytes

BREAKDOWN_CATEGORIES = ("parameters", "gradients", "optimizer state", "fixed part", "activations")


@dataclass(kw_only=True, frozen=True)
class MemoryBreakdown:
    """Bytes per category at one step's peak."""

    label: str
    """The step: baseline or plan."""
    peak_bytes: int
    """Its (predicted or measured) peak."""
    bytes_by_category: dict[str, int]
    """Bytes per name of `BREAKDOWN_CATEGORIES`, in that order."""


def breakdown_of(profile: Profile, point: StepPoint) -> MemoryBreakdown:
    """Split ``point``'s peak into the categories (see module docstring)."""
    if point.measured and profile.peak_bytes_by_category:
        return _measured_breakdown(profile, point.label)
    activations = point.peak_bytes - profile.model_state_bytes - point.fixed_bytes
    parts = {
        "parameters": profile.param_bytes + profile.buffer_bytes,
        "gradients": profile.gradient_bytes,
        "optimizer state": profile.optimizer_state_bytes,
        "fixed part": point.fixed_bytes,
        "activations": max(activations, 0),
    }
    return MemoryBreakdown(label=point.label, peak_bytes=point.peak_bytes, bytes_by_category=parts)


def _measured_breakdown(profile: Profile, label: str) -> MemoryBreakdown:
    """The measured baseline, from the tracker's categories at the measured peak (gradients
    may be partly allocated there). The tracker does not tell the fixed part from the blocks:
    the fixed part shown is what runs before the blocks, alive at any peak of forward or backward."""
    cat = profile.peak_bytes_by_category
    live_activations = cat.get("activations", 0) + cat.get("temporaries", 0)
    fixed = min(profile.fixed_pre_saved_bytes, live_activations)
    parts = {
        "parameters": cat.get("parameters", 0) + cat.get("buffers", 0),
        "gradients": cat.get("gradients", 0),
        "optimizer state": cat.get("optimizer_state", 0),
        "fixed part": fixed,
        "activations": live_activations - fixed,
    }
    return MemoryBreakdown(label=label, peak_bytes=profile.peak_bytes, bytes_by_category=parts)


def memory_breakdowns(profile: Profile, plans: Sequence[Plan] = ()) -> list[MemoryBreakdown]:
    """The baseline's breakdown first, then every plan other than ``none``."""
    rows = [breakdown_of(profile, baseline_point(profile, plans))]
    rows += [breakdown_of(profile, plan_point(p)) for p in plans if p.strategy_name != BASELINE_STRATEGY]
    return rows


def plot_breakdown(profile: Profile, plans: Sequence[Plan] = (), *,
                   budget_bytes: int | None = None) -> Figure:
    """Stacked horizontal bars: model state, fixed part and activations of each step's peak."""
    rows = memory_breakdowns(profile, plans)
    budget = report_budget(plans, budget_bytes)
    top = max([sum(r.bytes_by_category.values()) for r in rows] + [budget or 0])
    scale = byte_scale(top)
    fig = new_figure(7.5, 2.2 + 0.55 * len(rows))
    ax = fig.add_subplot()
    style_axes(ax)
    positions = list(range(len(rows)))[::-1]
    lefts = [0.0] * len(rows)
    for category in BREAKDOWN_CATEGORIES:
        widths = [scale(r.bytes_by_category[category]) for r in rows]
        color, hatch = CATEGORY_STYLE[category]
        ax.barh(positions, widths, left=lefts, height=0.6, label=category, color=color, hatch=hatch,
                edgecolor="black", linewidth=0.6)
        lefts = [a + w for a, w in zip(lefts, widths)]
    for pos, left, row in zip(positions, lefts, rows):
        ax.text(left, pos, f" {format_bytes(sum(row.bytes_by_category.values()))}", va="center",
                fontsize="small", bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
    if budget is not None:
        ax.axvline(scale(budget), color=BUDGET_COLOR, linestyle=BUDGET_LINESTYLE, linewidth=1.4,
                   label=f"budget {format_bytes(budget)}")
    ax.set_yticks(positions, [r.label for r in rows])
    ax.set_xlabel(f"memory at the step's peak ({scale.unit})")
    ax.set_title("Where the peak memory goes")
    ax.margins(x=0.15)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=3,
               fontsize="small", frameon=False)
    return fig
