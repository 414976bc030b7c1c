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
    import remat.checkpointing.region as region

    real = region.checkpoint
    monkeypatch.setattr(region, "checkpoint", lambda *a, **k: real(*a, **{**k, "preserve_rng_state": False}))


def test_demo_command_prints_one_table_of_every_strategy_and_three_budgets(tiny_demo, tmp_path):
    out = CliRunner().invoke(app, ["demo", "--repeats", "1", "--out", str(tmp_path / "demo")])
    assert out.exit_code == 0, out.output
    for text in ("remat demo", "selective:attention-core", "selective:save-matmuls", "optimal @", "identical",
                 "every gradient is identical to the baseline", "lowest peak", "The trade-off: a lower peak costs step time"):
        assert text in out.output
    result = tiny_demo[0]
    labels = [row.label for row in result.rows]
    assert labels[: len(DEMO_STRATEGIES)] == list(DEMO_STRATEGIES)
    assert [label.split(" @ ")[0] for label in labels[len(DEMO_STRATEGIES):]] == ["optimal"] * len(DEMO_BUDGET_FRACTIONS)
    budgets = [row.plan.budget_bytes for row in result.rows[len(DEMO_STRATEGIES):]]
    assert budgets == sorted(budgets) and len(set(budgets)) == 3
    assert all(row.plan.prediction.peak_bytes <= row.plan.budget_bytes for row in result.rows[len(DEMO_STRATEGIES):])
    # an optimal row may chunk the head: then within that head's stated tolerance, else bit-identical
    assert result.all_identical and all(r.verification.recompute_counts_match for r in result.rows)
    assert all(r.verification.grads_identical for r in result.rows if r.plan.head == "keep")
    assert result.plans[0].strategy_name == "none" and result.profile.num_blocks == 3
    assert result.budget_bytes == budgets[1]
    _assert_compact_table_fits_80_columns(result)
    _assert_compact_table_fits_80_columns(_slowed(result))  # a loaded machine's wide times cut nothing needed
    # The command ends with the report's path; the page holds the job's plans and the commands.
    assert out.output.rstrip().splitlines()[-1].endswith(f"report: {tmp_path / 'demo' / 'report.html'}")
    page = (tmp_path / "demo" / "report.html").read_text()
    assert "remat demo --seed 0 --repeats 1" in page and "selective:attention-core" in page
    assert "http://" not in page and "https://" not in page
    names = sorted(p.name for p in (tmp_path / "demo").iterdir())
    assert names == sorted(["profile.json", "report.html", *(f"{kind}-{stem}.json" for kind in ("plan", "verification")
                                                               for stem in map(run_module.file_stem, labels))])


def _slowed(result):
    """``result`` as a loaded machine measures it: steps of seconds, overheads of four digits (the
    table once cut the gradients' word to 'identic…' at +925%/+107%)."""
    import dataclasses

    rows = tuple(dataclasses.replace(row, verification=dataclasses.replace(
        row.verification, predicted_step_ms=1234.5, measured_step_ms=23456.7, predicted_overhead_pct=925.0,
        overhead_pct=1070.0)) for row in result.rows)
    return dataclasses.replace(result, rows=rows)


def _assert_compact_table_fits_80_columns(result):
    from rich.console import Console

    from remat.cli.run import verification_table

    console = Console(width=80, record=True, color_system=None)
    console.print(verification_table(result, "demo", wide=False))
    lines = console.export_text().splitlines()
    assert "pred/meas" in lines[2] and max(map(len, lines)) <= 80
    # the tiny demo's peaks are 100 KiB to 1 MiB: the column reads in KiB, no decimal
    assert "peak KiB" in lines[1] and 100 * 2**10 <= max(r.verification.measured_peak_bytes for r in result.rows) < 2**20
    v = result.rows[1].verification
    row = next(line for line in lines if line.startswith("full "))
    assert f"{v.predicted_peak_bytes / 2**10:.0f}/{v.measured_peak_bytes / 2**10:.0f}" in row and "identical" in row


def test_demo_command_fails_when_a_gradient_differs(tiny_demo, monkeypatch, tmp_path):
    _break_rng(monkeypatch)
    monkeypatch.setattr(run_module, "DEMO_STRATEGIES", ("none", "full"))
    monkeypatch.setattr(run_module, "DEMO_BUDGET_FRACTIONS", (0.5,))
    out = CliRunner().invoke(app, ["demo", "--repeats", "1", "--out", str(tmp_path)])
    assert out.exit_code == 1
    assert "GRADIENTS DIFFER for: full" in out.output
    assert (tmp_path / "report.html").exists()  # the report shows the failure too


def test_run_then_verify_the_saved_plan(tmp_path, monkeypatch):
    from remat.cli._app import console

    monkeypatch.setattr(console, "width", 200)
    out_dir = tmp_path / "run"
    out = CliRunner().invoke(app, ["run", "--model", "gpt", "--budget", "85%", "--repeats", "1", *TINY_OPTIONS,
                                   "--device", "cpu", "--out", str(out_dir)])
    assert out.exit_code == 0, out.output
    assert "optimal @ 85%" in out.output and f"report: {out_dir / 'report.html'}" in out.output
    assert "--batch 2 --device cpu" in out.output  # the verify command it suggests runs on the same device
    plan_path = out_dir / "plan-optimal-85pct.json"
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "plan-none.json", plan_path.name, "profile.json", "report.html", "verification-none.json",
        "verification-optimal-85pct.json"]
    plan = remat.Plan.load(plan_path)
    assert plan.strategy_name == "optimal" and plan.prediction.peak_bytes <= plan.budget_bytes
    page = (out_dir / "report.html").read_text()
    assert "remat run --model gpt --strategy optimal --budget 85% --layers 3" in page
    out = CliRunner().invoke(app, ["verify", str(plan_path), "--model", "gpt", "--repeats", "1", *TINY_OPTIONS])
    assert out.exit_code == 0, out.output
    assert "identical" in out.output


def test_run_without_a_budget_plans_at_the_least_peak_where_forty_percent_cannot_fit(tmp_path, monkeypatch):
    """`remat run --model mlp` (and unet, hf:gpt2, hf:llama, convnet at their default sizes) failed
    at run's default 40 %: model state alone is more. Without --budget the share is raised to the
    least peak any plan reaches, said in a note; a budget given is never raised."""
    from remat.cli._app import console
    from remat.plan.planners import min_peak_plan

    monkeypatch.setattr(console, "width", 200)
    sizes = ["--layers", "3", "--d-model", "16", "--batch", "4"]
    out = CliRunner().invoke(app, ["run", "--model", "mlp", "--repeats", "1", *sizes, "--out", str(tmp_path / "a")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert "note: the default budget 40% (" in text and "planned at that peak (pass --budget to choose)" in text
    assert "; no plan lowers this model's peak" in text  # at 3 layers of 16 the model state is the peak
    assert "optimal @ least peak" in text
    plan = remat.Plan.load(tmp_path / "a" / "plan-optimal-least-peak.json")
    profile = remat.Profile.load(tmp_path / "a" / "profile.json")
    assert plan.budget_bytes == min_peak_plan(profile).prediction.peak_bytes > 0.4 * profile.peak_bytes
    given = CliRunner().invoke(app, ["run", "--model", "mlp", "--budget", "40%", "--repeats", "1", *sizes,
                                     "--out", str(tmp_path / "b")])
    assert given.exit_code == 2 and "Model state alone needs" in " ".join(given.output.split())


def test_run_with_an_offload_dir_repeats_it_in_the_commands_it_prints(tmp_path, monkeypatch):
    """The report's reproduce command and the "apply it again" line dropped --offload-dir: the
    plan they remake could not offload where the first one did."""
    from remat.cli._app import console

    monkeypatch.setattr(console, "width", 400)
    out_dir, disk = tmp_path / "run", tmp_path / "disk"
    out = CliRunner().invoke(app, ["run", "--model", "gpt", "--budget", "90%", "--repeats", "1", *TINY_OPTIONS,
                                   "--offload-dir", str(disk), "--out", str(out_dir)])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"apply it again: remat verify {out_dir / 'plan-optimal-90pct.json'} --model gpt" in text
    assert text.count(f"--offload-dir {disk}") == 1 and f"--batch 2 --offload-dir {disk}" in text
    assert f"--seed 0 --offload-dir {disk} --out {out_dir}" in (out_dir / "report.html").read_text()


def test_demo_job_verifies_the_strategies_and_budgets_it_is_given():
    result = run_module.demo_job(model_name="gpt", sizes=TINY_GPT, repeats=1, strategies=("none", "full"),
                                 budget_fractions=(0.5, 1.0))
    middle, top = run_module.demo_budgets(result.profile, result.baseline, (0.5, 1.0))
    baseline_peak = run_module.baseline_peak(result.profile, result.baseline)
    assert [r.label for r in result.rows] == ["none", "full", f"optimal @ {100 * middle / baseline_peak:.0f}%",
                                              f"optimal @ {100 * top / baseline_peak:.0f}%"]
    assert top == result.baseline.prediction.peak_bytes  # fraction 1.0: the baseline peak itself
    # bit-identical, or for a plan that chunks the head within that head's stated tolerance
    assert all(r.verification.grads_identical if r.plan.head == "keep" else r.verification.ok for r in result.rows)


def test_file_stems_and_an_output_path_that_is_a_file(tmp_path):
    assert run_module.file_stem("optimal @ 40%") == "optimal-40pct"
    assert run_module.file_stem("selective:attention-core") == "selective-attention-core"
    assert run_module._unique(["a", "b", "a"]) == ["0-a", "b", "2-a"]
    (tmp_path / "taken").write_text("")
    out = CliRunner().invoke(app, ["run", "--budget", "85%", "--repeats", "1", *TINY_OPTIONS, "--out", str(tmp_path / "taken")])
    assert out.exit_code == 2
    assert "a file is there, not a directory; pass a directory path" in " ".join(out.output.split())  # rich wraps long paths


def test_default_gpt_activations_dominate_so_40_percent_fits():
    torch.manual_seed(0)
    built = build("gpt")
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    assert profile.model_state_bytes < 0.1 * profile.peak_bytes
    chosen = make_plan(profile, budget="40%", strategy="optimal")
    assert chosen.prediction.peak_bytes <= 0.4 * profile.peak_bytes


def test_verify_command_rejects_a_plan_for_another_model(tmp_path):
    built = build("gpt", **TINY_GPT)
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    make_plan(profile, strategy="full").save(tmp_path / "plan.json")
    out = CliRunner().invoke(app, ["verify", str(tmp_path / "plan.json"), "--model", "gpt", "--layers", "2"])
    assert out.exit_code == 2
    assert "the plan does not match this model" in out.output


def test_run_refuses_a_device_this_machine_lacks_before_building():
    out = CliRunner().invoke(app, ["run", "--repeats", "1", *TINY_OPTIONS, "--device", "nope"])
    assert out.exit_code == 2
    assert "device='nope' is not a device name torch knows; use cpu, cuda or cuda:N." in out.output
    if not torch.cuda.is_available():
        out = CliRunner().invoke(app, ["profile", "--model", "gpt", *TINY_OPTIONS, "--device", "cuda"])
        assert out.exit_code == 2
        assert "device='cuda' is not available here" in out.output and "use --device cpu" in out.output


def test_run_reports_an_impossible_budget():
    out = CliRunner().invoke(app, ["run", "--budget", "1%", "--repeats", "1", *TINY_OPTIONS])
    assert out.exit_code == 2
    assert "budget" in out.output


def test_plan_command_says_whether_the_plan_fits():
    out = CliRunner().invoke(app, ["plan", "--model", "gpt", *TINY_OPTIONS, "--budget", "85%"])
    assert out.exit_code == 0, out.output
    assert " fits the budget of " in out.output and "% predicted step time" in out.output
    out = CliRunner().invoke(app, ["plan", "--model", "gpt", *TINY_OPTIONS, "--budget", "90%", "--strategy", "none"])
    assert out.exit_code == 2
    assert "strategy 'none' predicts a peak of" in out.output and "strategy 'optimal' fits it" in out.output
