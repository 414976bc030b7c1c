"""Live memory over one training step: baseline against plans, the budget, each peak's block.

The timelines are `MemoryEvent` sequences recorded by the live-memory tracker at block
boundaries: `Profile.timeline` for the baseline step, `Verification.timeline` for each planned
step. The x axis is the event's position in the step (forward, then backward, then the
optimizer step), so the phases line up across steps with the same blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from remat.measure.types import MemoryEvent, Profile
from remat.report.style import BUDGET_COLOR, BUDGET_LINESTYLE, new_figure, series_style, style_axes
from remat.report.units import byte_scale, format_bytes
from remat.verify_types import Verification

BASELINE_TIMELINE_LABEL = "no recomputation (measured)"
PHASE_NAMES = {"fwd": "forward", "bwd": "backward", "opt": "optimizer"}


@dataclass(kw_only=True, frozen=True)
class TimelinePeak:
    """The highest point of one timeline."""

    position: int
    """Index of the event in the timeline."""
    live_bytes: int
    """Live bytes there."""
    where: str
    """Block name, ``pre``, ``post``, ``optimizer``, or empty outside blocks."""
    phase: str
    """``fwd``, ``bwd`` or ``opt``."""


def timeline_peak(events: Sequence[MemoryEvent]) -> TimelinePeak:
    """The first event with the most live bytes."""
    if not events:
        raise ValueError("empty timeline: it has no peak; record one with the live-memory tracker.")
    pos = max(range(len(events)), key=lambda i: (events[i].live_bytes, -i))
    ev = events[pos]
    return TimelinePeak(position=pos, live_bytes=ev.live_bytes, where=ev.where, phase=ev.phase)


def timeline_series(profile: Profile, verifications: Sequence[Verification] = ()
                    ) -> list[tuple[str, tuple[MemoryEvent, ...]]]:
    """(label, events) of every non-empty timeline: the baseline first, then each verification."""
    series = [(BASELINE_TIMELINE_LABEL, profile.timeline)] if profile.timeline else []
    for ver in verifications:
        if ver.timeline:
            budget = f" @ {format_bytes(ver.budget_bytes)}" if ver.budget_bytes is not None else ""
            series.append((f"{ver.strategy_name}{budget} (measured)", ver.timeline))
    return series


def plot_timeline(profile: Profile, verifications: Sequence[Verification] = (), *,
                  budget_bytes: int | None = None) -> Figure:
    """Live bytes at each block boundary of the step, baseline and planned, peaks annotated."""
    series = timeline_series(profile, verifications)
    if not series:
        raise ValueError(
            "no memory timeline to plot: the profile and the verifications carry none; "
            "profile the model with a remat version that records `Profile.timeline`."
        )
    top = max(max(e.live_bytes for e in events) for _, events in series)
    scale = byte_scale(max(top, budget_bytes or 0))
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    style_axes(ax)
    _shade_phases(ax, series[0][1])
    for i, (label, events) in enumerate(series):
        color, marker, linestyle = series_style(i)
        ax.plot(range(len(events)), [scale(e.live_bytes) for e in events], color=color,
                linestyle=linestyle, marker=marker, markersize=3, linewidth=1.6, label=label)
        _annotate_peak(ax, scale, timeline_peak(events), color, offset_index=i)
    if budget_bytes is not None:
        ax.axhline(scale(budget_bytes), color=BUDGET_COLOR, linestyle=BUDGET_LINESTYLE,
                   linewidth=1.2, label=f"budget {format_bytes(budget_bytes)}")
    _label_axes(fig, ax, scale.unit)
    return fig


def _label_axes(fig: Figure, ax, unit: str) -> None:
    ax.set_xlabel("position in the training step (block boundaries: forward, backward, optimizer)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title("Memory over one training step")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.2)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=3,
               fontsize="small", frameon=False)


def _shade_phases(ax, events: Sequence[MemoryEvent]) -> None:
    """A light band per phase with its name on top, from the first timeline's phases."""
    start = 0
    for i in range(1, len(events) + 1):
        if i == len(events) or events[i].phase != events[start].phase:
            name = PHASE_NAMES.get(events[start].phase, events[start].phase)
            if events[start].phase == "bwd":
                ax.axvspan(start - 0.5, i - 0.5, color="#000000", alpha=0.06, linewidth=0)
            ax.text((start + i - 1) / 2, 0.02, name, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize="small", color="#444444", style="italic")
            start = i


def _annotate_peak(ax, scale, peak: TimelinePeak, color: str, *, offset_index: int) -> None:
    where = peak.where or "the fixed part"
    ax.annotate(f"peak {format_bytes(peak.live_bytes)}\nin {where} ({PHASE_NAMES.get(peak.phase, peak.phase)})",
                xy=(peak.position, scale(peak.live_bytes)),
                xytext=(12, -28 - 26 * offset_index), textcoords="offset points", fontsize="small",
                color="black", arrowprops={"arrowstyle": "->", "color": color},
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "alpha": 0.9})
