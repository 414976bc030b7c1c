"""`remat plan --tune` and `remat run --tune` on a tiny built-in model: they run, print the tuning
table and write the tuning record (the plan JSON, the report's Tuning section)."""

from typer.testing import CliRunner

from remat.cli import app
from remat.plan.types import Plan

runner = CliRunner()
TINY = ["--model", "mlp", "--layers", "3", "--d-model", "32", "--batch", "256"]


def test_plan_tune_prints_the_candidates_and_writes_the_record(tmp_path):
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", *TINY, "--budget", "75%", "--tune", "--tune-steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    tuning = plan.tuning
    assert tuning is not None and tuning.rounds == 2 and tuning.max_steps == 2 and tuning.max_seconds == 30.0
    assert tuning.candidates[0].name.startswith("optimal")
    assert all(c.predicted_peak_bytes <= plan.budget_bytes for c in tuning.candidates)
    winner = next(c for c in tuning.candidates if c.name == tuning.winner)
    assert winner.segments == plan.segments and not winner.dropped and winner.rounds == 2
    assert "measured tuning: candidates timed side by side" in result.output and "winner" in result.output


def test_plan_tune_needs_the_model(tmp_path):
    result = runner.invoke(app, ["plan", str(tmp_path / "p.json"), "--budget", "50%", "--tune"])
    assert result.exit_code != 0
    assert "--tune times plans on the model, which a profile JSON does not hold" in " ".join(result.output.split())


def test_run_tune_writes_the_tuned_plan_and_the_reports_tuning_section(tmp_path):
    result = runner.invoke(app, ["run", *TINY, "--budget", "75%", "--repeats", "1", "--tune", "--tune-steps", "1",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "plan-optimal-75pct-tuned.json")
    assert plan.tuning is not None and plan.tuning.rounds == 1
    page = (tmp_path / "report.html").read_text()
    assert '<section id="tuning"><h2>Tuning</h2>' in page and "--tune --tune-steps 1 --tune-seconds 30" in page
