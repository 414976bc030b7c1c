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
