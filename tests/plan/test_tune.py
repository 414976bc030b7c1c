"""Measured tuning: the candidate set on hand-made profiles, the choice on given measurements, and
the Tuner on a real tiny model with a deterministic timing function (exact, not timing-dependent)."""

import dataclasses
import json

import pytest
import torch

import remat
from remat.apply.tune import Tuner
from remat.models.registry import build
from remat.plan.planners import min_peak_plan
from remat.plan.tune import Candidate, Measurement, TuneBounds, choose, sequential_segments, tune_candidates
from remat.plan.types import Plan, Segment

from plan_toys import chain

MIB = 2**20
BASIC = ("none", "full", "sqrt", "checkpoint_sequential")


def _toy():
    # 2 MiB of state; each block: 1 MiB input, 4 MiB saved, fwd 1 ms, bwd 2 ms (a step of 18 ms)
    return chain(6, input_bytes=MIB, saved_bytes=4 * MIB, param_bytes=MIB, grad_bytes=MIB)


def _layout(candidate):
    return [(s.start, s.stop, s.strategy, tuple((c.start, c.stop, c.strategy) for c in s.children))
            for s in candidate.plan.segments]


def test_candidates_at_16_mib_the_optimum_is_checkpoint_sequentials_layout_timed_once():
    found = tune_candidates(_toy(), 16 * MIB, recipes=BASIC)
    # none (26 MiB) does not fit; full: 2 + 5 x 1 held + 4 = 11 MiB; sqrt replays 3 blocks beside one
    # held input: 2 + 1 + 8 + 4 = 15 MiB; checkpoint_sequential's recompute [0, 3) then keep 3-5:
    # 2 + 1 + 8 + 4 = 15 MiB at 18 + 3 ms, which is the optimum too.
    assert [c.name for c in found] == ["optimal = checkpoint_sequential", "optimal #2", "optimal #3", "full", "sqrt"]
    assert [(c.plan.prediction.peak_bytes // MIB, c.plan.prediction.step_ms) for c in found] == [
        (15, 21.0), (12, 22.0), (10, 23.0), (11, 24.0), (15, 24.0)]
    assert _layout(found[0]) == [(0, 3, "recompute", ()), (3, 4, "keep", ()), (4, 5, "keep", ()), (5, 6, "keep", ())]
    assert _layout(found[1]) == [(0, 2, "recompute", ()), (2, 4, "recompute", ()), (4, 5, "keep", ()), (5, 6, "keep", ())]
    assert _layout(found[4]) == [(0, 3, "recompute", ()), (3, 6, "recompute", ())]
    assert all(c.plan.budget_bytes == 16 * MIB for c in found)


def test_candidates_at_the_baseline_peak_no_recomputation_is_the_optimum():
    found = tune_candidates(_toy(), 26 * MIB, recipes=BASIC)
    assert [c.name for c in found] == ["optimal = none", "optimal #2", "optimal #3", "full", "sqrt",
                                       "checkpoint_sequential"]
    assert all(s.strategy == "keep" for s in found[0].plan.segments)


def test_candidates_at_12_mib_leave_out_every_recipe_over_the_budget():
    found = tune_candidates(_toy(), 12 * MIB, recipes=BASIC, num_optimal=2)
    assert [c.name for c in found] == ["optimal", "optimal #2", "full"]
    assert [c.plan.prediction.peak_bytes // MIB for c in found] == [12, 10, 11]


def test_default_candidates_include_the_selective_policies_all_fit_all_distinct():
    found = tune_candidates(_toy(), 16 * MIB)
    names = [c.name for c in found]
    assert {"selective:save-matmuls", "selective:attention-core", "selective:knapsack"} <= set(names)
    assert all(c.plan.prediction.peak_bytes <= 16 * MIB for c in found)
    layouts = [(c.plan.segments, c.plan.head) for c in found]
    assert len(set(layouts)) == len(layouts) == len(set(names))


def test_candidates_refuse_a_budget_below_the_floor_and_a_bad_count():
    floor = min_peak_plan(_toy()).prediction.peak_bytes
    with pytest.raises(ValueError, match="minimum feasible peak|least feasible"):
        tune_candidates(_toy(), floor - 1)
    with pytest.raises(ValueError, match="num_optimal=0 must be an integer >= 1"):
        tune_candidates(_toy(), 16 * MIB, num_optimal=0)


@pytest.mark.parametrize("num_blocks, expected", [
    (4, [(0, 2, "recompute"), (2, 3, "keep"), (3, 4, "keep")]),
    (5, [(0, 2, "recompute"), (2, 3, "keep"), (3, 4, "keep"), (4, 5, "keep")]),
    (9, [(0, 3, "recompute"), (3, 6, "recompute"), (6, 7, "keep"), (7, 8, "keep"), (8, 9, "keep")]),
    (1, [(0, 1, "keep")]),
])
def test_sequential_segments_are_checkpoint_sequentials_with_round_sqrt_segments(num_blocks, expected):
    profile = chain(num_blocks, input_bytes=1, saved_bytes=4)
    assert [(s.start, s.stop, s.strategy) for s in sequential_segments(profile)] == expected


def _candidates():
    return tune_candidates(_toy(), 16 * MIB, recipes=BASIC)


BOUNDS = TuneBounds(max_steps=20, max_seconds=30.0, rounds=3, seconds=1.5)


def test_choose_keeps_the_least_measured_median_and_records_every_candidate():
    found = _candidates()
    measured = [Measurement(step_ms=(30.0, 31.0, 29.0), peak_bytes=15 * MIB),
                Measurement(step_ms=(25.0, 26.0, 50.0), peak_bytes=12 * MIB),
                Measurement(step_ms=(20.0, 21.0, 22.0), peak_bytes=16 * MIB + 1),  # fastest, over the budget
                Measurement(error="RuntimeError: out of memory"),
                Measurement(step_ms=(27.0, 24.0, 28.0), peak_bytes=15 * MIB)]
    plan = choose(found, measured, 16 * MIB, BOUNDS)
    assert plan.segments == found[1].plan.segments and plan.tuning.winner == "optimal #2"
    records = plan.tuning.candidates
    assert [r.measured_step_ms for r in records] == [30.0, 26.0, 21.0, None, 27.0]
    assert [r.rounds for r in records] == [3, 3, 3, 0, 3]
    assert records[2].dropped == ("measured peak 16.00 MiB (16777217 bytes) over the budget of 16.00 MiB "
                                  "(16777216 bytes)")
    assert records[3].dropped == "failed: RuntimeError: out of memory"
    assert [r.dropped for r in (records[0], records[1], records[4])] == ["", "", ""]
    assert records[0].predicted_step_ms == 21.0 and records[0].predicted_peak_bytes == 15 * MIB
    assert (plan.tuning.rounds, plan.tuning.max_steps, plan.tuning.max_seconds) == (3, 20, 30.0)


def test_choose_breaks_ties_by_the_cost_models_order_and_refuses_when_all_are_dropped():
    found = _candidates()
    same = [Measurement(step_ms=(10.0,), peak_bytes=MIB)] * len(found)
    assert choose(found, same, 16 * MIB, BOUNDS).tuning.winner == found[0].name
    over = [Measurement(step_ms=(10.0,), peak_bytes=17 * MIB)] * len(found)
    with pytest.raises(ValueError, match=r"no candidate that runs within the budget of 16.00 MiB .*optimal #2: measured "
                                         r"peak 17.00 MiB .*Raise the budget"):
        choose(found, over, 16 * MIB, BOUNDS)
    with pytest.raises(ValueError, match="5 candidates but 1 measurements"):
        choose(found, same[:1], 16 * MIB, BOUNDS)


def test_tuned_plan_round_trips_through_json_and_old_files_load_without_tuning():
    found = _candidates()
    measured = [Measurement(step_ms=(float(i + 1),), peak_bytes=MIB) for i in range(len(found))]
    plan = choose(found, measured, 16 * MIB, BOUNDS)
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="tuning winner 'nobody' is not one of the candidates"):
        dataclasses.replace(plan.tuning, winner="nobody")
    doc = json.loads(plan.to_json())
    del doc["data"]["tuning"]
    old = Plan.from_json(json.dumps(doc))
    assert old.tuning is None and old.segments == plan.segments


# a real tiny model: profile once per module

@pytest.fixture(scope="module")
def tiny():
    built = build("mlp", depth=4, width=32, batch_size=256)
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    floor = min_peak_plan(profile).prediction.peak_bytes
    top = remat.plan(profile, strategy="none").prediction.peak_bytes
    return built, profile, (floor + top) // 2


class ScriptedTimes:
    """A deterministic `TimeStep`: runs the step, returns the time given to the plan's layout."""

    def __init__(self, ms_by_layout):
        self.ms_by_layout = ms_by_layout
        self.calls = []

    def __call__(self, plan, run):
        run()
        key = (plan.segments, plan.head)
        self.calls.append(key)
        return self.ms_by_layout[key]


def test_tuner_picks_the_measured_fastest_with_interleaved_rotated_rounds(tiny):
    built, profile, budget = tiny
    found = tune_candidates(profile, budget)
    assert len(found) >= 3
    layouts = [(c.plan.segments, c.plan.head) for c in found]
    # the last candidate (a recipe) is the fastest measured, whatever the prediction says
    times = ScriptedTimes({key: 50.0 - i for i, key in enumerate(layouts)})
    before = [p.detach().clone() for p in built.model.parameters()]
    state = json.dumps(str(built.optimizer.state_dict()["state"]))
    plan = remat.plan(profile, budget, tune=Tuner(built.model, built.batch, built.loss_fn, built.optimizer,
                                                  max_steps=3, time_step=times))
    assert plan.tuning.winner == found[-1].name and plan.segments == found[-1].plan.segments
    assert plan.prediction == found[-1].plan.prediction
    assert [c.name for c in plan.tuning.candidates] == [c.name for c in found]
    assert [c.measured_step_ms for c in plan.tuning.candidates] == [50.0 - i for i in range(len(found))]
    assert all(c.rounds == 3 and not c.dropped for c in plan.tuning.candidates)
    assert all(0 < c.measured_peak_bytes <= budget and c.device_peak_bytes is None for c in plan.tuning.candidates)
    # round r times the candidates from the r-th on (rotated), each once
    k = len(layouts)
    assert times.calls == [layouts[(r + i) % k] for r in range(3) for i in range(k)]
    assert plan.tuning.rounds == 3
    # the model, its gradients and the optimizer are as they were; no plan is left applied
    assert all(torch.equal(a, p) for a, p in zip(before, built.model.parameters()))
    assert json.dumps(str(built.optimizer.state_dict()["state"])) == state
    assert not hasattr(built.model, "_remat_runtime")


def test_tuner_stops_after_the_round_that_spends_the_seconds(tiny):
    built, profile, budget = tiny
    times = ScriptedTimes({(c.plan.segments, c.plan.head): 1.0 for c in tune_candidates(profile, budget)})
    plan = remat.tune(built.model, built.batch, profile, budget, built.loss_fn, built.optimizer, max_steps=20,
                      max_seconds=1e-9, time_step=times)
    assert plan.tuning.rounds == 1 and all(c.rounds == 1 for c in plan.tuning.candidates)
    assert plan.tuning.winner == plan.tuning.candidates[0].name  # all equal: the cost model's first


def test_tune_needs_a_tuner_the_optimal_strategy_and_a_budget(tiny):
    built, profile, budget = tiny
    with pytest.raises(TypeError, match=r"tune=True: tuning runs the model.*remat.Tuner\(model, batch"):
        remat.plan(profile, budget, tune=True)
    tuner = Tuner(built.model, built.batch, built.loss_fn, built.optimizer)
    with pytest.raises(ValueError, match="strategy 'full' is one plan already"):
        remat.plan(profile, budget, strategy="full", tune=tuner)
    with pytest.raises(ValueError, match="give budget="):
        remat.plan(profile, tune=tuner)
    with pytest.raises(ValueError, match="max_steps=0 must be an integer >= 1"):
        Tuner(built.model, built.batch, max_steps=0)
    with pytest.raises(ValueError, match="max_seconds=0 must be a number of seconds > 0"):
        Tuner(built.model, built.batch, max_seconds=0)
    assert remat.plan(profile, budget, tune=False) == remat.plan(profile, budget)


def test_tuning_refuses_a_compiled_profile_before_it_runs_anything(tiny):
    """Tuning times eager steps: for a plan made for the compiled model their times and peaks
    would pick the winner by the wrong step."""
    built, profile, budget = tiny
    compiled = dataclasses.replace(profile, compiled_backend="inductor")
    before = [p.detach().clone() for p in built.model.parameters()]
    times = ScriptedTimes({})
    with pytest.raises(ValueError, match=r"compiled with backend 'inductor', and tuning times the candidates' eager "
                                         r"steps.*remat.verify"):
        remat.plan(compiled, budget, tune=Tuner(built.model, built.batch, built.loss_fn, built.optimizer,
                                                time_step=times))
    assert times.calls == [] and all(torch.equal(a, p) for a, p in zip(before, built.model.parameters()))
