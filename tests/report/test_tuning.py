"""The report's Tuning section: predicted against measured for each candidate, the winner marked."""

import dataclasses
import re

from report_samples import MIB, make_plans, make_profile
from remat.plan.types import Segment, TunedCandidate, Tuning
from remat.report.html import render_html
from remat.report.tuning import layout_text, tuning_sentence, tuning_table


def _tuned():
    plans = make_plans()
    optimal, full = plans["optimal"], plans["full"]
    tuning = Tuning(candidates=(
        TunedCandidate(name="optimal", segments=optimal.segments, predicted_step_ms=34.0, predicted_peak_bytes=79 * MIB,
                       measured_step_ms=40.0, measured_peak_bytes=79 * MIB, rounds=5),
        TunedCandidate(name="full", segments=full.segments, predicted_step_ms=38.0, predicted_peak_bytes=76 * MIB,
                       measured_step_ms=36.0, measured_peak_bytes=76 * MIB, rounds=5),
        TunedCandidate(name="checkpoint_sequential", segments=(Segment(start=0, stop=2, strategy="recompute"),
                                                               Segment(start=2, stop=4, strategy="keep")),
                       predicted_step_ms=33.0, predicted_peak_bytes=80 * MIB, measured_step_ms=30.0,
                       measured_peak_bytes=81 * MIB, rounds=5, dropped="measured peak 81.00 MiB over the budget"),
    ), winner="full", max_steps=20, max_seconds=30.0, rounds=5, seconds=1.25)
    return dataclasses.replace(full, budget_bytes=80 * MIB, tuning=tuning), plans


def test_tuning_table_rows_predicted_against_measured_winner_marked():
    tuned, _ = _tuned()
    (headers, rows), winner = tuning_table(tuned.tuning)
    assert headers[:5] == ("candidate", "layout", "predicted step", "measured step (median)", "measured vs predicted")
    assert winner == 1
    assert rows[0] == ("optimal", "keep 0, recompute [1-3]", "34.0 ms", "40.0 ms", "+18%", "79.0 MiB", "79.0 MiB", "5", "")
    assert rows[1] == ("full", "recompute 0-3", "38.0 ms", "36.0 ms", "-5.3%", "76.0 MiB", "76.0 MiB", "5", "winner")
    assert rows[2][-1] == "dropped: measured peak 81.00 MiB over the budget"
    sentence = tuning_sentence(tuned.tuning)
    assert "3 layouts predicted to fit the budget were timed side by side" in sentence
    assert "5 rounds" in sentence and "at most 20 steps per candidate or 30 s of rounds" in sentence
    assert "full won at a median of 36.0 ms, against 40.0 ms for the cost model's choice (optimal)" in sentence
    assert "1 dropped" in sentence


def test_layout_text_merges_runs_of_single_blocks_and_names_the_head():
    segs = (Segment(start=0, stop=1, strategy="keep"), Segment(start=1, stop=2, strategy="keep"),
            Segment(start=2, stop=4, strategy="recompute"), Segment(start=4, stop=5, strategy="recompute"),
            Segment(start=5, stop=6, strategy="selective:save-matmuls"))
    assert layout_text(segs) == "keep 0-1, recompute [2-3], recompute 4, selective:save-matmuls 5"
    assert layout_text(segs[:2], "chunked:64") == "keep 0-1; head chunked:64"


def test_page_has_a_tuning_section_only_for_a_tuned_plan():
    tuned, plans = _tuned()
    page = render_html(make_profile(), [plans["none"], tuned])
    assert '<section id="tuning"><h2>Tuning</h2>' in page and 'href="#tuning"' in page
    section = page.split('<section id="tuning">')[1].split("</section>")[0]
    assert re.search(r'<tr class="chosen"><td>full</td>', section)
    assert "checkpoint_sequential" in section and "dropped: measured peak" in section
    assert '<section id="tuning">' not in render_html(make_profile(), [plans["none"], plans["full"]])
