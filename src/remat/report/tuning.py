"""The report's "Tuning" section: every layout measured tuning timed, predicted against measured.

`tuning_table` returns ``(headers, rows)`` and the index of the winner's row; the HTML page
(`remat.report.html`) and the terminal (`remat plan --tune`, `remat run --tune`) render it.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.plan.types import Plan, Segment, TunedCandidate, Tuning
from remat.report.units import format_bytes, format_ms, format_pct

__all__ = ["TUNING_HEADERS", "tuned_plan", "tuning_table", "tuning_sentence", "layout_text"]

TUNING_HEADERS = ("candidate", "layout", "predicted step", "measured step (median)", "measured vs predicted",
                  "predicted peak", "measured peak", "timed steps", "result")


def tuned_plan(plans: Sequence[Plan]) -> Plan | None:
    """The first of ``plans`` that measured tuning chose, or None."""
    return next((p for p in plans if p.tuning is not None), None)


def layout_text(segments: Sequence[Segment], head: str = "keep") -> str:
    """``"recompute [0-1], keep 2-3"``: runs of single blocks with one strategy are merged
    (``0-3``); a recompute segment of several blocks is bracketed (its nesting is left out)."""
    parts: list[tuple[str, int, int, bool]] = []  # strategy, first, last, one segment of several blocks
    for seg in segments:
        grouped = seg.num_blocks > 1 and seg.kind == "recompute"
        if parts and not grouped and not parts[-1][3] and parts[-1][0] == seg.strategy and parts[-1][2] == seg.start - 1:
            parts[-1] = (seg.strategy, parts[-1][1], seg.stop - 1, False)
        else:
            parts.append((seg.strategy, seg.start, seg.stop - 1, grouped))
    text = ", ".join(f"{s} [{a}-{b}]" if grouped else f"{s} {a}" + ("" if a == b else f"-{b}")
                     for s, a, b, grouped in parts)
    return text if head == "keep" else f"{text}; head {head}"


def _row(c: TunedCandidate, winner: str) -> tuple[str, ...]:
    measured = "-" if c.measured_step_ms is None else format_ms(c.measured_step_ms)
    ratio = ("-" if c.measured_step_ms is None or c.predicted_step_ms <= 0
             else format_pct(100.0 * (c.measured_step_ms / c.predicted_step_ms - 1.0)))
    peak = "-" if c.measured_peak_bytes is None else format_bytes(c.measured_peak_bytes)
    result = "winner" if c.name == winner else (f"dropped: {c.dropped}" if c.dropped else "")
    return (c.name, layout_text(c.segments, c.head), format_ms(c.predicted_step_ms), measured, ratio,
            format_bytes(c.predicted_peak_bytes), peak, str(c.rounds), result)


def tuning_table(tuning: Tuning) -> tuple[tuple[tuple[str, ...], list[tuple[str, ...]]], int]:
    """One row per candidate in the order timed, and the index of the winner's row."""
    rows = [_row(c, tuning.winner) for c in tuning.candidates]
    winner = next(i for i, c in enumerate(tuning.candidates) if c.name == tuning.winner)
    return (TUNING_HEADERS, rows), winner


def tuning_sentence(tuning: Tuning) -> str:
    """What was timed, within which bound, and what won, in words."""
    count = len(tuning.candidates)
    dropped = sum(1 for c in tuning.candidates if c.dropped)
    win = next(c for c in tuning.candidates if c.name == tuning.winner)
    first = tuning.candidates[0]
    text = (f"{count} layouts predicted to fit the budget were timed side by side through the real runtime: "
            f"{tuning.rounds} rounds, each timing one step of every candidate in an order rotated every round "
            f"(at most {tuning.max_steps} steps per candidate or {tuning.max_seconds:g} s of rounds, whichever "
            f"first; {tuning.seconds:.1f} s spent; warm-up and peak-tracking steps not counted). "
            f"{tuning.winner} won at a median of {format_ms(win.measured_step_ms)}")
    if win is not first and first.measured_step_ms is not None:
        text += f", against {format_ms(first.measured_step_ms)} for the cost model's choice ({first.name})"
    text += "."
    if dropped:
        text += f" {dropped} dropped (measured peak over the budget, or failed)."
    return text
