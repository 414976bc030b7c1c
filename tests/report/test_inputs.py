"""Reading the report's inputs: kinds by "format", one profile, plans that match it; the CLI."""

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from report_samples import make_plans, make_profile, make_verification
from remat.cli import app
from remat.report.inputs import document_kind, load_inputs


@pytest.fixture
def files(tmp_path):
    paths = {"profile": tmp_path / "profile.json", "plan": tmp_path / "optimal.json",
             "full": tmp_path / "full.json", "verification": tmp_path / "verify.json"}
    make_profile(timeline=False).save(paths["profile"])
    make_plans()["optimal"].save(paths["plan"])
    make_plans()["full"].save(paths["full"])
    make_verification(timeline=False).save(paths["verification"])
    return paths


def test_kinds_are_read_from_the_format_field_in_any_order(files):
    assert document_kind(files["verification"]) == "verification"
    inputs = load_inputs([files["verification"], files["plan"], files["profile"], files["full"]])
    assert inputs.profile == make_profile(timeline=False)
    assert [p.strategy_name for p in inputs.plans] == ["optimal", "full"]
    assert inputs.verifications == (make_verification(timeline=False),)


def test_bad_inputs_are_explained(tmp_path, files):
    with pytest.raises(ValueError, match=r"exactly one profile JSON, got 0"):
        load_inputs([files["plan"]])
    with pytest.raises(ValueError, match=r"exactly one profile JSON, got 2"):
        load_inputs([files["profile"], files["profile"]])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "quiz", "version": 1}))
    with pytest.raises(ValueError, match=r"format='quiz'; allowed: \['plan', 'profile', 'verification'\]"):
        load_inputs([files["profile"], other])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*broken.json' as JSON"):
        document_kind(broken)
    foreign = tmp_path / "foreign.json"
    plan = make_plans()["full"]
    dataclasses.replace(plan, fingerprint=dataclasses.replace(plan.fingerprint, model_hash="ffff")).save(foreign)
    with pytest.raises(ValueError, match=r"made for model 'ffff', the profile is of model 'c0ffee12'"):
        load_inputs([files["profile"], foreign])


def test_a_plan_of_another_batch_dtype_or_device_is_refused(tmp_path, files):
    """A plan made at batch 8 beside a profile taken at batch 4 (the same model) headlined
    +133 % at 1.3x less memory where the batch-8 run was +23 % at 2.6x."""
    plan = make_plans()["full"]
    shapes = make_profile(timeline=False).fingerprint.batch_shapes
    for field, value, shown in (("batch_shapes", ("8x64:int64",), f"batch shapes ['8x64:int64'], the profile was taken "
                                 f"with {list(shapes)!r}"),
                                ("dtype", "bfloat16", "dtype bfloat16, the profile was taken with float32"),
                                ("device", "cuda", "device cuda, the profile was taken with cpu")):
        other = tmp_path / f"other-{field}.json"
        dataclasses.replace(plan, fingerprint=dataclasses.replace(plan.fingerprint, **{field: value})).save(other)
        with pytest.raises(ValueError, match=re.escape(f"plan 'full' was made for {shown}: ") + ".*Pass the profile the plan was made from"):
            load_inputs([files["profile"], other])


def test_cli_writes_the_report_and_prints_its_path(tmp_path, files):
    out = tmp_path / "r" / "report.html"
    result = CliRunner().invoke(app, ["report", str(files["profile"]), str(files["plan"]), str(files["full"]),
                                      str(files["verification"]), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "report:" in result.output and out.name in result.output
    page = out.read_text(encoding="utf-8")
    assert "The optimal plan fits 80.0 MiB" in page
    assert f"remat report {files['profile']} {files['plan']}" in page and f"-o {out}" in page


def test_cli_budget_option(tmp_path, files):
    out = tmp_path / "report.html"
    args = ["report", str(files["profile"]), str(files["plan"]), str(files["full"]), "-o", str(out)]
    result = CliRunner().invoke(app, [*args, "--budget", "70MiB"])
    assert result.exit_code == 0, result.output
    assert "No plan fits 70.0 MiB: the smallest, full, peaks at 76.0 MiB" in out.read_text(encoding="utf-8")
    result = CliRunner().invoke(app, [*args, "--budget", "lots"])
    assert result.exit_code == 2
    assert "cannot read budget 'lots'" in result.output


def test_cli_reports_bad_input_without_traceback(tmp_path, files):
    result = CliRunner().invoke(app, ["report", str(files["plan"]), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert "exactly one profile JSON, got 0" in result.output
    assert "Traceback" not in result.output
