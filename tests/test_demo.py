"""The default job and the run/verify commands, end to end on tiny models."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import remat.apply.run as run_module
import remat
from remat.apply.run import DEMO_BUDGET_FRACTIONS, DEMO_STRATEGIES
from remat.models import build
from remat.plan.planners import plan as make_plan
from remat.cli import app

TINY_GPT = {"num_layers": 3, "d_model": 16, "num_heads": 2, "seq_len": 32, "batch_size": 2, "vocab_size": 32}
TINY_OPTIONS = ["--layers", "3", "--d-model", "16", "--heads", "2", "--seq", "32", "--batch", "2"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_demo(monkeypatch):
    from remat.cli._app import console

    monkeypatch.setattr(run_module, "DEMO_SIZES", dict(TINY_GPT))
    monkeypatch.setattr(console, "width", 200)
    results = []
    real = run_module.demo_job
    monkeypatch.setattr(run_module, "demo_job", lambda **kw: results.append(real(**kw)) or results[-1])
    return results


def _break_rng(monkeypatch):
    import remat.apply.strategies as strategies

    real = strategies.checkpoint
    monkeypatch.setattr(strategies, "checkpoint", lambda *a, **k: real(*a, **{**k, "preserve_rng_state": False}))


def test_demo_command_prints_one_table_of_every_strategy_and_three_budgets(tiny_demo):
    out = CliRunner().invoke(app, ["demo", "--repeats", "1"])
    assert out.exit_code == 0, out.output
    for text in ("remat demo", "selective:attention-core", "selective:save-matmuls", "optimal @", "identical",
                 "every gradient is identical", "lowest peak"):
        assert text in out.output
    result = tiny_demo[0]
    labels = [row.label for row in result.rows]
    assert labels[: len(DEMO_STRATEGIES)] == list(DEMO_STRATEGIES)
    assert [label.split(" @ ")[0] for label in labels[len(DEMO_STRATEGIES):]] == ["optimal"] * len(DEMO_BUDGET_FRACTIONS)
    budgets = [row.plan.budget_bytes for row in result.rows[len(DEMO_STRATEGIES):]]
    assert budgets == sorted(budgets) and len(set(budgets)) == 3
    assert all(row.plan.prediction.peak_bytes <= row.plan.budget_bytes for row in result.rows[len(DEMO_STRATEGIES):])
    assert result.all_identical and all(v.grads_identical and v.recompute_counts_match for v in result.verifications)
    assert result.plans[0].strategy_name == "none" and result.profile.num_blocks == 3


def test_demo_command_fails_when_a_gradient_differs(tiny_demo, monkeypatch):
    _break_rng(monkeypatch)
    monkeypatch.setattr(run_module, "DEMO_STRATEGIES", ("none", "full"))
    monkeypatch.setattr(run_module, "DEMO_BUDGET_FRACTIONS", (0.5,))
    out = CliRunner().invoke(app, ["demo", "--repeats", "1"])
    assert out.exit_code == 1
    assert "GRADIENTS DIFFER for: full" in out.output


def test_run_then_verify_the_saved_plan(tmp_path, monkeypatch):
    from remat.cli._app import console

    monkeypatch.setattr(console, "width", 200)
    plan_path, json_path = tmp_path / "plan.json", tmp_path / "v.json"
    out = CliRunner().invoke(app, ["run", "--model", "gpt", "--budget", "85%", "--repeats", "1", *TINY_OPTIONS,
                                   "--out", str(plan_path), "--json", str(json_path)])
    assert out.exit_code == 0, out.output
    assert "optimal @ 85%" in out.output and plan_path.exists() and json_path.exists()
    out = CliRunner().invoke(app, ["verify", str(plan_path), "--model", "gpt", "--repeats", "1", *TINY_OPTIONS],
)
    assert out.exit_code == 0, out.output
    assert "identical" in out.output


def test_verify_command_rejects_a_plan_for_another_model(tmp_path):
    built = build("gpt", **TINY_GPT)
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    make_plan(profile, strategy="full").save(tmp_path / "plan.json")
    out = CliRunner().invoke(app, ["verify", str(tmp_path / "plan.json"), "--model", "gpt", "--layers", "2"])
    assert out.exit_code == 2
    assert "the plan does not match this model" in out.output


def test_run_reports_an_impossible_budget():
    out = CliRunner().invoke(app, ["run", "--budget", "1%", "--repeats", "1", *TINY_OPTIONS])
    assert out.exit_code == 2
    assert "budget" in out.output
