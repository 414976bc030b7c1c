"""benchmarks/compiled.py: its arguments and its matched-peak table (the run itself compiles the
model a dozen times with inductor: minutes, so it is a benchmark, not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import compiled  # noqa: E402
from benchmarks._peers.results import Match  # noqa: E402


@pytest.mark.parametrize("argv", [["--budgets", "1.0"], ["--budgets", "0"], ["--repeats", "0"]])
def test_bad_arguments_are_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        compiled.parse_args(argv)
    assert "must" in capsys.readouterr().err


def test_the_command_line_reproduces_the_arguments() -> None:
    args = compiled.parse_args(["--size", "tiny", "--budgets", "0.5", "--threads", "1", "--dropout", "0"])
    assert compiled.command_line(args) == ("python -m benchmarks.compiled --model gpt --size tiny --budgets 0.5 "
                                           "--repeats 7 --warmup 2 --threads 1 --dropout 0.0")


def test_the_goal_is_met_at_one_and_missed_above() -> None:
    def match(remat_ms: float | None) -> Match:
        return Match(peer="compile budget 0.5", mode="compile", peer_peak_bytes=2**20, peer_ms=10.0,
                     best_peer="compile budget 0.5", best_peer_ms=10.0, remat=None if remat_ms is None else "remat",
                     remat_peak_bytes=None if remat_ms is None else 2**20, remat_ms=remat_ms)

    table = compiled.match_table([match(10.0), match(10.1), match(None)]).splitlines()
    assert table[2].endswith("| 1.00 | met |")
    assert table[3].endswith("| 1.01 | missed |")
    assert table[4].endswith("| - | no remat run fits |")


def test_the_time_model_table_compares_ratios_to_the_step_without_a_plan() -> None:
    """A plan predicted at 66 ms against 60 without a plan (1.10) that measures 77 ms beside a
    plain compile of 70 (1.10) has no step error; one measuring 84 (1.20) is 9.1 % above."""
    from types import SimpleNamespace

    def run(name: str, predicted: float, measured: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, step_ms=measured,
                               plan=SimpleNamespace(prediction=SimpleNamespace(step_ms=predicted)))

    table, rows = compiled.time_model_table([run("a", 66.0, 77.0), run("b", 66.0, 84.0)], 70.0, 60.0)
    assert [round(r["error_pct"], 1) for r in rows] == [0.0, 9.1]
    assert table.splitlines()[2] == "| a | 66.0 | 77.0 | 1.100 | 1.100 | +0.0% |"
