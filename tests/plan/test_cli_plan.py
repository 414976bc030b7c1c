"""`remat plan` on a profile JSON (the --model path profiles a real model: see the models tests)."""

import json
import re

from typer.testing import CliRunner

from remat.cli import app
from remat.plan.types import Plan

from plan_toys import chain

runner = CliRunner()


def _profile_file(tmp_path, **fields):
    path = tmp_path / "profile.json"
    chain(6, input_bytes=2**20, saved_bytes=4 * 2**20, param_bytes=2**20, grad_bytes=2**20, **fields).save(path)
    return path


def test_plan_writes_json_and_prints_comparison(tmp_path):
    # keep all: block 5's backward: 1 MiB params + 1 MiB grads + 5 * 4 held + 4 working = 26 MiB.
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(_profile_file(tmp_path)), "--budget", "12MiB", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.budget_bytes == 12 * 2**20 and plan.strategy_name == "optimal"
    assert plan.prediction.peak_bytes <= 12 * 2**20
    assert json.loads(out.read_text())["format"] == "plan"
    assert "peak MiB" in result.output and "26.00" in result.output
    assert "recompute" in result.output
    assert "no plan of the search space that fits the budget is predicted faster" in " ".join(result.output.split())
    assert plan.optimality.exact and plan.optimality.quantum_bytes == 1


def test_plan_percent_budget_uses_baseline(tmp_path):
    result = runner.invoke(app, ["plan", str(_profile_file(tmp_path)), "--budget", "50%", "--strategy", "full"])
    assert result.exit_code == 0, result.output
    assert "budget 13.00 MiB" in result.output


def test_plan_pareto_table(tmp_path):
    result = runner.invoke(app, ["plan", str(_profile_file(tmp_path)), "--pareto"])
    assert result.exit_code == 0, result.output
    assert "fastest plan at each predicted peak" in result.output
    assert "keep x6" in result.output


def _error(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())


def test_plan_errors_are_messages_without_traceback(tmp_path):
    path = str(_profile_file(tmp_path))
    assert "unknown unit 'G'" in _error(["plan", path, "--budget", "6G"])
    assert "Model state alone needs" in _error(["plan", path, "--budget", "1MiB"])
    # least peak: 2 MiB state + 1 MiB held input + block 5's 4 MiB working set = 7 MiB.
    assert "minimum feasible peak with keep, recompute, nested segments and selective policies is 7.00 MiB" in _error(
        ["plan", path, "--budget", "3MiB"])
    assert "--model NAME" in _error(["plan"])


def test_pareto_with_options_it_would_ignore_is_refused(tmp_path):
    """`plan --pareto --budget 40% -o p.json` printed the frontier, wrote no file and said nothing."""
    path = str(_profile_file(tmp_path))
    out = tmp_path / "p.json"
    message = _error(["plan", path, "--pareto", "--budget", "40%", "--out", str(out)])
    assert "--pareto prints every optimal plan from no recomputation to the least peak, so --budget, --out would be " \
           "ignored" in message
    assert not out.exists()


def test_the_budget_an_error_suggests_is_one_the_command_takes(tmp_path):
    """"Raise the budget to at least 7340032 bytes" was refused as a budget (a unit is
    required): the message now writes it the way --budget reads it."""
    path = str(_profile_file(tmp_path))
    suggested = re.search(r"Raise the budget to at least (\S+?),", _error(["plan", path, "--budget", "3MiB"]))[1]
    assert suggested == f"{7 * 2**20}B"
    result = runner.invoke(app, ["plan", path, "--budget", suggested])
    assert result.exit_code == 0, result.output


def test_plan_with_the_head_named_and_searched(tmp_path):
    from test_plan_head import _profile

    path = tmp_path / "head.json"
    _profile().save(path)
    result = runner.invoke(app, ["plan", str(path), "--budget", "200B"])
    assert result.exit_code == 0, result.output
    assert "chunked:4" in result.output and "no logits returned" in result.output  # the head row
    named = runner.invoke(app, ["plan", str(path), "--strategy", "full", "--head", "chunked:2"])
    assert named.exit_code == 0 and "chunked:2" in named.output
    missing = runner.invoke(app, ["plan", str(path), "--head", "chunked:3"])
    assert missing.exit_code != 0 and "head strategy 'chunked:3' was not measured" in missing.output
    frontier = runner.invoke(app, ["plan", str(path), "--pareto"])
    assert "head chunked:2" in frontier.output


def test_plan_on_slots_says_how_far_it_may_be(tmp_path):
    """A chain longer than the byte-exact search takes: the plan names the slot and its bound."""
    from plan_toys import block, profile

    blocks = [block(i, input_bytes=2**20 + 3, saved_bytes=4 * 2**20 + 7 * i, fwd_ms=1.0 + i / 100) for i in range(60)]
    path = tmp_path / "long.json"
    profile(blocks, param_bytes=2**20, grad_bytes=2**20).save(path)
    result = runner.invoke(app, ["plan", str(path), "--budget", "40MiB"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "slower than the fastest plan that fits (memory counted in slots of" in text


def test_a_fixed_layout_that_lowers_no_peak_is_called_out(tmp_path):
    """On two blocks, sqrt makes one segment of both: its replay holds both blocks' saved bytes
    beside the segment's input, above no recomputation's peak."""
    path = tmp_path / "profile.json"
    chain(2, input_bytes=2**20, saved_bytes=4 * 2**20, param_bytes=2**20, grad_bytes=2**20).save(path)
    result = runner.invoke(app, ["plan", str(path), "--strategy", "sqrt"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "this sqrt plan is predicted to peak at" in text and "no lower than no recomputation" in text
    result = runner.invoke(app, ["plan", str(path), "--strategy", "full"])
    assert "no lower than no recomputation" not in " ".join(result.output.split())


def test_plan_for_one_rank_of_a_sharded_step(tmp_path):
    """--world-size/--zero plan on `shard_profile`'s view: at ZeRO-3 over 4 ranks each rank holds a
    quarter of the weights and gradients and the root unit gathered (these toy blocks own no
    weights: all 1 MiB is the root's). Keep all: 0.25 + 0.25 + 1 + 5 x 4 held + 4 working."""
    path = _profile_file(tmp_path)
    result = runner.invoke(app, ["plan", str(path), "--strategy", "none", "--world-size", "4", "--zero", "3"])
    assert result.exit_code == 0, result.output
    assert "25.50" in result.output and "26.00" not in result.output
    # a percentage budget is of the rank's predicted peak
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(path), "--budget", "50%", "--world-size", "4", "--zero", "3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert Plan.load(out).budget_bytes == int(25.5 * 2**20) // 2
    # ZeRO-1 over 2 ranks: DDP's buckets (a copy of every gradient) beside halved optimizer state
    result = runner.invoke(app, ["plan", str(path), "--strategy", "none", "--world-size", "2", "--zero", "1"])
    assert result.exit_code == 0, result.output
    assert "27.00" in result.output


def test_sharding_options_that_cannot_work_are_refused(tmp_path):
    from remat.distributed import shard_profile
    from remat.measure.types import Profile

    path = str(_profile_file(tmp_path))
    assert "--zero 3 shards model state over data-parallel ranks: give their number with --world-size N" in _error(
        ["plan", path, "--zero", "3"])
    assert "world_size must be an integer >= 1, got 0" in _error(["plan", path, "--world-size", "0"])
    assert "zero_stage must be 0, 1, 2 or 3, got 4" in _error(["plan", path, "--world-size", "2", "--zero", "4"])
    assert "--tune times plans on this process's model, unsharded" in _error(
        ["plan", "--model", "mlp", "--world-size", "2", "--tune"])
    rank = tmp_path / "rank.json"
    shard_profile(Profile.load(path), world_size=4, zero_stage=3).save(rank)
    assert "the profile is one rank's of a sharded step already" in _error(
        ["plan", str(rank), "--world-size", "4", "--zero", "3"])
