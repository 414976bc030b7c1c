"""benchmarks/profile_cost.py keeps working: its arithmetic by hand and one tiny run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.profile_cost import Row, main, markdown  # noqa: E402


def test_steps_target_and_table_by_hand():
    fast = Row(model="mlp", blocks=8, step_ms=25.0, profile_s=1.0, measured_blocks=2, unshared_s=None)
    slow = Row(model="gpt", blocks=16, step_ms=2000.0, profile_s=41.0, measured_blocks=1, unshared_s=60.0)
    assert (fast.steps, fast.target_s) == (40.0, 10.0)  # 20 steps are 0.5 s: the 10 s floor holds
    assert (slow.steps, slow.target_s) == (20.5, 40.0)
    lines = markdown([fast, slow]).splitlines()
    assert lines[2] == "| mlp | 8 | 25.0 | 1.00 | 40.0 | 10.0 | yes | 2/8 |  |"
    assert lines[3] == "| gpt | 16 | 2000.0 | 41.00 | 20.5 | 40.0 | no | 1/16 | 60.00 |"


def test_a_tiny_run_writes_its_table(tmp_path, capsys):
    out = tmp_path / "cost.md"
    main(["--mlp-depths", "3", "--gpt-layers", "", "--markdown", str(out)])
    row = out.read_text().splitlines()[2].split(" | ")
    assert row[0] == "| mlp" and row[1] == "3" and row[7] == "2/3 |"  # block 0 takes the batch: its own probes
