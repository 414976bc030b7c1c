"""benchmarks/shared_layers.py keeps working: a tiny run of each model, its checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shared_layers import main, run_case  # noqa: E402


@pytest.mark.parametrize("name", ["universal", "gru", "albert"])
def test_a_tiny_run_plans_every_call_with_identical_gradients(name):
    case, results, _ = run_case(name, repeats=1, small=True)
    by = {r.name: r for r in results}
    assert list(by) == ["none", "every call", "remat @ every call", "remat sqrt", "remat least peak"]
    assert all(r.identical for r in results)
    assert by["every call"].peak_bytes <= by["none"].peak_bytes
    assert by["remat @ every call"].peak_bytes <= by["every call"].peak_bytes  # the plan holds the peer's peak
    for r in results[2:]:  # remat's predicted peaks of its own plans: within 0.5 % of the measured
        assert abs(r.peak_bytes - r.predicted_bytes) <= 0.005 * r.peak_bytes


def test_the_table_has_a_row_per_strategy(tmp_path):
    out = tmp_path / "shared.md"
    assert main(["--models", "universal", "--small", "--repeats", "1", "--markdown", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| strategy | what it does | peak MiB")
    assert rows[1].startswith("| --- |")
    assert [r.split(" | ")[0] for r in rows[2:]] == ["| none", "| every call", "| remat @ every call", "| remat sqrt",
                                                      "| remat least peak"]
    assert all(r.endswith("| identical |") for r in rows[2:])  # no chunked head at this size
