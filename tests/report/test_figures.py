"""The figures carry the right series, numbers, labels and units (Figure objects, not pixels)."""

import dataclasses
import xml.etree.ElementTree as ET

import pytest
from matplotlib.container import BarContainer

from report_samples import MIB, make_plans, make_profile, make_verification
from remat.report.blocks import block_bytes, plot_blocks
from remat.report.breakdown import BREAKDOWN_CATEGORIES, memory_breakdowns, plot_breakdown
from remat.report.frontier import pareto_points, plot_frontier
from remat.report.style import OKABE_ITO, figure_bytes, save_figure
from remat.report.timeline import plot_timeline, timeline_peak
from remat.report.units import GIB


def lines_by_label(ax):
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def bars_by_label(ax):
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def test_frontier_series_and_units(profile, plans, verification):
    fig = plot_frontier(profile, list(plans.values()), [verification])
    ax = fig.axes[0]
    assert ax.get_xlabel() == "peak memory of one training step (MiB)"
    assert ax.get_ylabel() == "step time (ms)"
    lines = lines_by_label(ax)
    assert set(lines) == {"optimal frontier (of the plans shown)", "full (predicted)", "optimal (predicted)",
                          "offload (predicted)", "measured (verify, hollow)", "no recomputation", "budget 80.0 MiB"}
    front = lines["optimal frontier (of the plans shown)"]
    assert list(front.get_xdata()) == [76.0, 79.0, 90.0, 100.0]
    assert list(front.get_ydata()) == [38.0, 34.0, 31.0, 30.0]
    assert front.get_drawstyle() == "steps-post"
    assert (list(lines["optimal (predicted)"].get_xdata()), list(lines["optimal (predicted)"].get_ydata())) == ([79.0], [34.0])
    (measured,) = [ln for ln in ax.get_lines() if ln.get_gid() == "measured"]
    assert (list(measured.get_xdata()), list(measured.get_ydata())) == ([81.0], [35.0])
    # the measurement is a hollow copy of its plan's marker, in its plan's colour
    assert measured.get_marker() == lines["optimal (predicted)"].get_marker()
    assert measured.get_color() == lines["optimal (predicted)"].get_color()
    assert measured.get_markerfacecolor() == "white"
    assert (list(lines["no recomputation"].get_xdata()), list(lines["no recomputation"].get_ydata())) == ([100.0], [30.0])
    assert lines["no recomputation"].get_marker() == "*"
    assert list(lines["budget 80.0 MiB"].get_xdata()) == [80.0, 80.0]
    markers = [lines[k].get_marker() for k in ("full (predicted)", "optimal (predicted)", "offload (predicted)")]
    assert len(set(markers)) == 3  # distinguishable without colour


def test_frontier_given_explicitly_and_in_gib(profile, plans):
    big = [dataclasses.replace(p, budget_bytes=2 * GIB) for p in (plans["full"], plans["optimal"])]
    fig = plot_frontier(profile, [plans["optimal"]], frontier=big, budget_bytes=2 * GIB)
    ax = fig.axes[0]
    assert ax.get_xlabel().endswith("(GiB)")
    lines = lines_by_label(ax)
    assert list(lines["optimal frontier"].get_xdata()) == [76 / 1024, 79 / 1024]
    assert list(lines["budget 2.0 GiB"].get_xdata()) == [2.0, 2.0]
    # Without a "none" plan the star is the profile's measured baseline step.
    assert list(lines["no recomputation"].get_xdata()) == [101 / 1024]
    assert list(lines["no recomputation"].get_ydata()) == [30.5]


def test_pareto_points_drop_dominated_plans():
    assert pareto_points([(5, 10.0), (3, 20.0), (4, 25.0), (5, 12.0), (8, 9.0), (3, 20.0)]) == [
        (3, 20.0), (5, 10.0), (8, 9.0)]


def test_block_bytes_kept_recomputed_offloaded(profile, plans):
    rows = block_bytes(profile, plans["optimal"])
    assert [(r.strategy, r.kept_bytes, r.recomputed_bytes, r.offloaded_bytes) for r in rows] == [
        ("keep", 8 * MIB, 0, 0), ("recompute", 1 * MIB, 7 * MIB, 0),
        ("recompute", 0, 8 * MIB, 0), ("recompute", 0, 8 * MIB, 0)]
    off = block_bytes(profile, plans["offload"])
    assert [(r.kept_bytes, r.offloaded_bytes, r.recomputed_bytes) for r in off] == [
        (MIB // 2, 15 * MIB // 2, 0), (MIB // 2, 15 * MIB // 2, 0), (8 * MIB, 0, 0), (8 * MIB, 0, 0)]


def test_block_bars_stack_per_category(profile, plans):
    fig = plot_blocks(profile, plans["optimal"])
    ax = fig.axes[0]
    bars = bars_by_label(ax)
    assert list(bars) == ["kept", "recomputed", "offloaded"]
    assert [b.get_height() for b in bars["kept"]] == [8.0, 1.0, 0.0, 0.0]
    assert [b.get_height() for b in bars["recomputed"]] == [0.0, 7.0, 8.0, 8.0]
    assert [b.get_y() for b in bars["recomputed"]] == [8.0, 1.0, 0.0, 0.0]
    assert ax.get_ylabel() == "activation bytes per block (MiB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0\nK", "1\nR", "2\nR", "3\nR"]
    hatches = {bars[k][0].get_hatch() or "" for k in bars}
    assert len(hatches) == 3  # grayscale-readable: each category has its own hatch
    assert bars["kept"][0].get_facecolor()[:3] == pytest.approx(_rgb(OKABE_ITO["blue"]))


def test_plan_for_another_model_is_refused(profile, plans):
    other = dataclasses.replace(plans["full"], fingerprint=dataclasses.replace(plans["full"].fingerprint,
                                                                                model_hash="deadbeef"))
    with pytest.raises(ValueError, match=r"made for model 'deadbeef'.*pass the profile the plan was made from"):
        block_bytes(profile, other)
    fewer = dataclasses.replace(profile, blocks=profile.blocks[:3])
    with pytest.raises(ValueError, match=r"\(4\) but the profile has .*\(3\)"):
        plot_blocks(fewer, plans["full"])


def test_timeline_baseline_against_plan(profile, verification):
    fig = plot_timeline(profile, [verification], budget_bytes=80 * MIB)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "live memory (MiB)"
    lines = lines_by_label(ax)
    base = lines["no recomputation (measured)"]
    planned = lines["optimal @ 80.0 MiB (measured)"]
    assert list(base.get_ydata()) == [e.live_bytes / MIB for e in profile.timeline]
    assert list(planned.get_ydata()) == [e.live_bytes / MIB for e in verification.timeline]
    assert max(base.get_ydata()) == 101.0 and max(planned.get_ydata()) == 81.0
    assert list(lines["budget 80.0 MiB"].get_ydata()) == [80.0, 80.0]
    notes = [t.get_text() for t in ax.texts]
    assert "peak 101.0 MiB\nin post (backward)" in notes
    assert "peak 81.0 MiB\nin post (backward)" in notes
    assert {"forward", "backward", "optimizer"} <= set(notes)


def test_timeline_peak_names_the_block():
    events = make_profile().timeline
    peak = timeline_peak(events)
    assert (peak.position, peak.where, peak.phase, peak.live_bytes) == (6, "post", "bwd", 101 * MIB)
    with pytest.raises(ValueError, match="empty timeline"):
        timeline_peak(())


def test_timeline_without_any_recording_is_an_error():
    with pytest.raises(ValueError, match=r"no memory timeline to plot.*Profile.timeline"):
        plot_timeline(make_profile(timeline=False), [make_verification(timeline=False)])


def test_breakdown_rows_and_bars(profile, plans):
    rows = memory_breakdowns(profile, list(plans.values()))
    assert [r.label for r in rows] == ["none", "full", "optimal @ 80.0 MiB", "offload"]
    assert rows[2].bytes_by_category == {"parameters": 16 * MIB, "gradients": 16 * MIB,
                                         "optimizer state": 32 * MIB, "fixed part": 3 * MIB,
                                         "activations": 12 * MIB}
    fig = plot_breakdown(profile, list(plans.values()))
    ax = fig.axes[0]
    bars = bars_by_label(ax)
    assert list(bars) == list(BREAKDOWN_CATEGORIES)
    # none: 100 - 64 - 3; full: 76 - 67; optimal: 79 - 67; offload: 90 - 67 (MiB)
    assert [b.get_width() for b in bars["activations"]] == [33.0, 9.0, 12.0, 23.0]
    assert [b.get_x() for b in bars["activations"]] == [67.0] * 4
    assert [t.get_text() for t in ax.get_yticklabels()] == ["none", "full", "optimal @ 80.0 MiB", "offload"]
    assert list(ax.get_yticks()) == [3, 2, 1, 0]  # the baseline on top
    assert ax.get_xlabel() == "memory at the step's peak (MiB)"
    assert list(lines_by_label(ax)["budget 80.0 MiB"].get_xdata()) == [80.0, 80.0]
    assert len({bars[k][0].get_hatch() or "" for k in bars}) == len(BREAKDOWN_CATEGORIES)


def test_breakdown_of_the_measured_baseline(profile):
    # tracker at the peak: 16 + 16 + 32 MiB state, 35 MiB activations + 2 MiB temporaries;
    # the 1 MiB saved before the blocks is the fixed part, the other 36 MiB activations.
    (row,) = memory_breakdowns(profile)
    assert row.label == "no recomputation (measured)"
    assert row.bytes_by_category == {"parameters": 16 * MIB, "gradients": 16 * MIB, "optimizer state": 32 * MIB,
                                     "fixed part": 1 * MIB, "activations": 36 * MIB}
    assert sum(row.bytes_by_category.values()) == row.peak_bytes == 101 * MIB


def test_save_png_and_svg(tmp_path, profile, plans):
    fig = plot_breakdown(profile, list(plans.values()))
    png = save_figure(fig, tmp_path / "sub" / "b.png")
    svg = save_figure(fig, tmp_path / "b.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    root = ET.fromstring(svg.read_bytes())
    assert root.tag.endswith("svg")
    assert figure_bytes(fig, "svg").startswith(b"<?xml")
    with pytest.raises(ValueError, match=r"unknown suffix '.jpg'; allowed: .png, .svg"):
        save_figure(fig, tmp_path / "b.jpg")


def _rgb(hex_color):
    return tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_timeline_peak_outside_blocks_is_named(profile):
    events = tuple(dataclasses.replace(e, where="") if e.where == "post" else e for e in profile.timeline)
    ax = plot_timeline(dataclasses.replace(profile, timeline=events)).axes[0]
    assert "peak 101.0 MiB\nin the fixed part (backward)" in [t.get_text() for t in ax.texts]
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_every_colour_is_from_the_okabe_ito_palette(profile, plans, verification):
    from matplotlib.colors import to_hex

    palette = {c.lower() for c in OKABE_ITO.values()}
    figs = [plot_breakdown(profile, list(plans.values())), plot_blocks(profile, plans["offload"]),
            plot_frontier(profile, list(plans.values()), [verification]), plot_timeline(profile, [verification])]
    for fig in figs:
        ax = fig.axes[0]
        colours = {to_hex(p.get_facecolor()) for c in ax.containers for p in c}
        colours |= {to_hex(ln.get_color()) for ln in ax.get_lines()}
        assert colours and colours <= palette, colours - palette
