import dataclasses

import pytest

from report_samples import MIB, make_plans, make_profile, make_verification
from remat.report.summary import baseline_point, choose_plan, report_budget, summary_sentence


def test_sentence_names_the_fastest_fitting_plan_with_exact_numbers(profile, plans):
    # optimal: 79 MiB <= 80 MiB budget, 34 ms vs 30 ms -> +13%; activations (100-64)/(79-64) = 2.4x.
    text = summary_sentence(profile, list(plans.values()))
    assert text == (
        "The optimal plan fits 80.0 MiB at +13% step time, 2.4x less activation memory than no "
        "recomputation (predicted peak 79.0 MiB vs 100.0 MiB)."
    )


def test_sentence_adds_what_verification_measured(profile, plans, verification):
    text = summary_sentence(profile, list(plans.values()), [verification])
    # measured 81 MiB is over the 80 MiB budget the plan was predicted to fit: the sentence says so
    assert text.endswith(
        "Measured: peak 81.0 MiB (+2.5% vs predicted, over the 80.0 MiB budget), step 35.0 ms "
        "(+15% vs baseline), gradients bit-identical."
    )
    within = dataclasses.replace(verification, measured_peak_bytes=79 * MIB, peak_error_pct=0.0)
    assert "Measured: peak 79.0 MiB (+0.0% vs predicted), step" in summary_sentence(
        profile, list(plans.values()), [within])


def test_nothing_fits_points_at_model_state(profile, plans):
    text = summary_sentence(profile, list(plans.values()), budget_bytes=70 * MIB)
    assert text.startswith("No plan fits 70.0 MiB: the smallest, full, peaks at 76.0 MiB; model state alone is 64.0 MiB")


def test_no_recomputation_already_fits(profile, plans):
    text = summary_sentence(profile, list(plans.values()), budget_bytes=128 * MIB)
    assert text == "No recomputation already fits 128.0 MiB (predicted peak 100.0 MiB): nothing to recompute."


def test_without_plans_reports_the_measured_baseline(profile):
    assert summary_sentence(profile).startswith(
        "No plan given: without recomputation the step peaks at 101.0 MiB and takes 30.5 ms")


def test_baseline_falls_back_to_the_measured_profile(profile, plans):
    assert baseline_point(profile, list(plans.values())).peak_bytes == 100 * MIB
    measured = baseline_point(profile, [plans["full"]])
    assert (measured.peak_bytes, measured.step_ms, measured.measured) == (101 * MIB, 30.5, True)
    assert measured.activation_bytes == 37 * MIB
    # full vs measured baseline: (38 / 30.5 - 1) = +25%, activations 37 / 12 = 3.1x
    assert summary_sentence(profile, [plans["full"]]).startswith(
        "The full plan peaks at 76.0 MiB at +25% step time, 3.1x less activation memory")


def test_budget_and_choice(plans):
    all_plans = list(plans.values())
    assert report_budget(all_plans) == 80 * MIB
    assert report_budget([plans["full"]]) is None
    assert choose_plan(all_plans, 80 * MIB).strategy_name == "optimal"
    assert choose_plan(all_plans, 95 * MIB).strategy_name == "offload"
    assert choose_plan(all_plans, None).strategy_name == "full"
    assert choose_plan(all_plans, 10 * MIB) is None
    twin = dataclasses.replace(plans["optimal"], strategy_name="sqrt", budget_bytes=None)
    assert choose_plan([twin, plans["optimal"]], 80 * MIB).strategy_name == "optimal"
    with pytest.raises(ValueError, match=r"budget_bytes must be positive, got -1"):
        report_budget(all_plans, -1)


def test_verification_of_another_budget_is_not_used(profile, plans):
    other = dataclasses.replace(make_verification(), budget_bytes=90 * MIB)
    assert "Measured" not in summary_sentence(make_profile(), list(make_plans().values()), [other])


def test_a_plan_holding_more_than_the_baseline_says_more(profile, plans):
    # offload alone against a measured baseline of 101 MiB: activations 90-64=26 vs 37 MiB -> 1.4x less;
    # against a baseline of 80 MiB (activations 16 MiB) it holds 26/16 = 1.6x more.
    lean = dataclasses.replace(profile, peak_bytes=80 * MIB)
    assert "1.4x less activation memory" in summary_sentence(profile, [plans["offload"]])
    assert "1.6x more activation memory" in summary_sentence(lean, [plans["offload"]])


def test_gradient_verdicts(profile, plans):
    close = dataclasses.replace(make_verification(), grads_identical=False, grad_max_abs_diff=2e-6, tolerance=1e-5)
    far = dataclasses.replace(close, grad_max_abs_diff=3e-4)
    assert summary_sentence(profile, list(plans.values()), [close]).endswith(
        "gradients within tolerance (max difference 2.0e-06 <= 1.0e-05).")
    assert summary_sentence(profile, list(plans.values()), [far]).endswith(
        "gradients DIFFER (max difference 3.0e-04 > tolerance 1.0e-05).")
