"""A budget the least-peak layout meets gets a plan even where every layout the search's curve
offers near it comes out over it under `predict` (a term its tables bound otherwise: e3nn's
networks, 24 small blocks and six shared tensors, had the curve's lowest point 74,556 bytes under
its prediction, and a budget equal to the least feasible peak was refused, its error naming that
same peak as the one to raise the budget to)."""

from __future__ import annotations

import random

from remat.plan.predict import predict
from remat.plan.search import OptimalSearch

from plan_toys import random_profile


def test_the_least_peak_layout_is_the_plan_where_the_curve_offers_nothing_that_fits(monkeypatch):
    prof = random_profile(random.Random(7), 5)
    search = OptimalSearch(prof)
    least = search.min_peak_segments()
    floor = predict(prof, least).peak_bytes
    assert search.choose(floor) is not None
    monkeypatch.setattr(search, "_exact_choice", lambda budget: None)  # the curve's layouts all over the budget
    choice = search.choose(floor)
    assert choice.segments == least
    assert choice.optimality.extra_ms == predict(prof, least).extra_ms and choice.optimality.lower_bound_ms == 0.0
    assert search.choose(floor - 1) is None
