"""`remat plan` on an edited or damaged profile file: one clear line, a non-zero exit, no plan
written, the file as it was; and `Plan.load` / `remat verify` on a bad plan file the same."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from plan_toys import chain
from remat.cli import app

runner = CliRunner()


def _profile_text() -> str:
    return chain(4, input_bytes=2**20, saved_bytes=4 * 2**20, param_bytes=2**20, grad_bytes=2**20).to_json()


def _edited(edit) -> str:
    doc = json.loads(_profile_text())
    edit(doc["data"])
    return json.dumps(doc, indent=1)


def _set_block(field, value):
    return lambda data: data["blocks"][2].__setitem__(field, value)


CASES = {
    "negative time": (_edited(_set_block("fwd_ms", -1000)),
                      r"data\.blocks\[2\]\.fwd_ms is -1000\.0; times of 'fwd_ms' must be >= 0"),
    "infinite bytes": (_profile_text().replace('"saved_bytes": 4194304', '"saved_bytes": Infinity', 1),
                       r"profile JSON holds Infinity; every number must be finite"),
    "NaN time": (_profile_text().replace('"bwd_ms": ', '"bwd_ms": NaN, "z": ', 1), r"profile JSON holds NaN"),
    "bool for int": (_edited(_set_block("saved_bytes", True)), r"saved_bytes is a boolean True; expected an integer"),
    "negative step": (_edited(lambda d: d.__setitem__("step_ms", -5.0)), r"data\.step_ms is -5\.0; times"),
    "a path": ("/dev/zero", r"not valid JSON .* it starts '/dev/zero'"),
    "empty": ("", r"is empty"),
    "a plan": (json.dumps({"format": "plan", "version": 1, "data": {}}), r"expected a remat 'profile' JSON document"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_profile_file_is_one_line_and_changes_nothing(tmp_path, case):
    text, match = CASES[case]
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    path.write_text(text)
    result = runner.invoke(app, ["plan", str(path), "--budget", "50%", "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert re.search(match, " ".join(result.output.split())), result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert path.read_text() == text and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


def test_a_device_or_a_directory_is_not_read(tmp_path):
    for target, match in (("/dev/zero", r"'/dev/zero' is not a regular file \(a character device\)"),
                          (str(tmp_path), r"is not a regular file \(a directory\)")):
        result = runner.invoke(app, ["plan", target, "--budget", "50%"])
        assert result.exit_code == 2 and re.search(match, " ".join(result.output.split())), result.output
    assert list(tmp_path.iterdir()) == []


def _plan_text() -> str:
    from remat.plan.planners import plan

    return plan(chain(4, input_bytes=2**20, saved_bytes=4 * 2**20, param_bytes=2**20, grad_bytes=2**20),
                strategy="full").to_json()


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d["data"].__setitem__("block_names", ["b0", "b0", "b2", "b3"]), r"block_names\[1\] 'b0' appears twice"),
    (lambda d: d["data"].__setitem__("segments", [{"start": 0, "stop": 4, "strategy": "recompute", "children": [
        {"start": 0, "stop": 2, "strategy": "recompute"}, {"start": 1, "stop": 3, "strategy": "recompute"}]}]),
     r"must be in order without overlap"),
    (lambda d: d["data"]["prediction"].__setitem__("step_ms", float("nan")), r"plan JSON holds NaN"),
])
def test_remat_verify_refuses_a_bad_plan_file_before_building_anything(tmp_path, edit, match):
    doc = json.loads(_plan_text())
    edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    result = runner.invoke(app, ["verify", str(path), "--model", "mlp"])
    assert result.exit_code == 2 and re.search(match, " ".join(result.output.split())), result.output
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_remat_report_refuses_a_device_and_an_edited_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(CASES["negative time"][0])
    for target, match in (("/dev/zero", r"is not a regular file \(a character device\)"),
                          (str(path), r"fwd_ms is -1000\.0; times of 'fwd_ms' must be >= 0")):
        result = runner.invoke(app, ["report", target, "-o", str(tmp_path / "report.html")])
        assert result.exit_code != 0 and re.search(match, " ".join(result.output.split())), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]
