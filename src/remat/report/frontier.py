"""The memory-time trade-off: predicted peak against predicted step time, one point per plan.

Drawn on one axes: every plan given (one marker per planner), the optimal frontier as a
staircase (for a budget ``x``, the fastest step whose peak is at most ``x``), measured points
from `remat.verify` joined to their predictions, the budget as a vertical line and the
no-recomputation point marked with a star.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.report.style import BUDGET_COLOR, BUDGET_LINESTYLE, OKABE_ITO, new_figure, series_style, style_axes
from remat.report.summary import BASELINE_STRATEGY, baseline_point, report_budget
from remat.report.units import ByteScale, byte_scale, format_bytes
from remat.verify_types import Verification

FRONTIER_LABEL = "optimal frontier"
MEASURED_LABEL = "measured (verify, hollow)"
MEASURED_GID = "measured"
BASELINE_LABEL = "no recomputation"


def pareto_points(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The non-dominated (peak_bytes, step_ms) pairs, by increasing peak (decreasing time)."""
    front: list[tuple[int, float]] = []
    for peak, step in sorted(set(points), key=lambda p: (p[0], p[1])):
        if not front or step < front[-1][1]:
            front.append((peak, step))
    return front


def plot_frontier(profile: Profile, plans: Sequence[Plan] = (),
                  verifications: Sequence[Verification] = (), *,
                  frontier: Sequence[Plan] = (), budget_bytes: int | None = None) -> Figure:
    """Peak memory against step time for ``plans``; ``frontier`` (e.g. `remat.pareto`'s plans)
    draws the optimal frontier, else the non-dominated plans given draw it. The ``none`` plan
    (or, without one, the profile's measured step) is the no-recomputation star."""
    budget = report_budget(plans, budget_bytes)
    base = baseline_point(profile, plans)
    all_bytes = [base.peak_bytes, *(p.prediction.peak_bytes for p in (*plans, *frontier)),
                 *(v.measured_peak_bytes for v in verifications)]
    scale = byte_scale(max(all_bytes + ([budget] if budget else [])))
    fig = new_figure(7.5, 5.2)
    ax = fig.add_subplot()
    style_axes(ax)
    _draw_frontier(ax, scale, frontier or plans, derived=not frontier)
    styles = _plan_styles(plans)
    _draw_plans(ax, scale, [p for p in plans if p.strategy_name != BASELINE_STRATEGY], styles)
    _draw_measured(ax, scale, verifications, styles)
    ax.plot([scale(base.peak_bytes)], [base.step_ms], linestyle="none", marker="*", markersize=16,
            color=OKABE_ITO["black"], markerfacecolor=OKABE_ITO["yellow"], label=BASELINE_LABEL, zorder=5)
    if budget is not None:
        ax.axvline(scale(budget), color=BUDGET_COLOR, linestyle=BUDGET_LINESTYLE, linewidth=1.2,
                   label=f"budget {format_bytes(budget)}")
    ax.set_xlabel(f"peak memory of one training step ({scale.unit})")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Memory-time trade-off (predicted unless marked measured)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=3,
               fontsize="small", frameon=False)
    ax.margins(x=0.08, y=0.12)
    return fig


def _draw_frontier(ax, scale: ByteScale, plans: Sequence[Plan], *, derived: bool) -> None:
    front = pareto_points([(p.prediction.peak_bytes, p.prediction.step_ms) for p in plans])
    if len(front) < 2:
        return
    label = FRONTIER_LABEL if not derived else f"{FRONTIER_LABEL} (of the plans shown)"
    ax.plot([scale(b) for b, _ in front], [t for _, t in front], drawstyle="steps-post",
            color=OKABE_ITO["sky_blue"], linewidth=2.0, linestyle="-", label=label, zorder=2)


def _plan_styles(plans: Sequence[Plan]) -> dict[str, tuple[str, str]]:
    """(colour, marker) per planner name, in the order the plans come; ``none`` is the star."""
    names = [n for n in dict.fromkeys(p.strategy_name for p in plans) if n != BASELINE_STRATEGY]
    styles = {name: series_style(i)[:2] for i, name in enumerate(names)}
    styles[BASELINE_STRATEGY] = (OKABE_ITO["black"], "*")
    return styles


def _draw_plans(ax, scale: ByteScale, plans: Sequence[Plan], styles: dict[str, tuple[str, str]]) -> None:
    for name in dict.fromkeys(p.strategy_name for p in plans):
        group = [p for p in plans if p.strategy_name == name]
        color, marker = styles[name]
        ax.plot([scale(p.prediction.peak_bytes) for p in group], [p.prediction.step_ms for p in group],
                linestyle="none", marker=marker, markersize=8, color=color, markeredgecolor="black",
                label=f"{name} (predicted)", zorder=4)


def _draw_measured(ax, scale: ByteScale, verifications: Sequence[Verification],
                   styles: dict[str, tuple[str, str]]) -> None:
    """Each measurement as a hollow copy of its plan's marker, joined to its prediction."""
    for ver in verifications:
        color, marker = styles.get(ver.strategy_name, (OKABE_ITO["black"], "o"))
        xs = [scale(ver.predicted_peak_bytes), scale(ver.measured_peak_bytes)]
        ys = [ver.predicted_step_ms, ver.measured_step_ms]
        ax.plot(xs, ys, color=OKABE_ITO["black"], linestyle=":", linewidth=1.0, zorder=3)
        point, = ax.plot(xs[1:], ys[1:], linestyle="none", marker=marker, markersize=10, markerfacecolor="white",
                         markeredgewidth=1.8, color=color, label=f"_measured {ver.strategy_name}", zorder=6)
        point.set_gid(MEASURED_GID)
    if verifications:
        ax.plot([], [], linestyle="none", marker="o", markersize=10, markerfacecolor="white",
                markeredgewidth=1.8, color=OKABE_ITO["black"], label=MEASURED_LABEL)
