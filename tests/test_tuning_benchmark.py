"""benchmarks/tuning.py keeps working: the recipe budgets on a hand-made profile, the table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "plan"))

from benchmarks.tuning import _recipe_budgets, markdown  # noqa: E402
from plan_toys import chain  # noqa: E402

MIB = 2**20


def test_recipe_budgets_are_each_recipes_predicted_peak_below_no_recomputation():
    # 6 blocks, 1 MiB inputs, 4 MiB saved, 2 MiB state: none 26 MiB, full 11, sqrt and checkpoint_sequential 15;
    # the selective policies find no op to save on these op-less blocks: 11 MiB
    budgets = dict(_recipe_budgets(chain(6, input_bytes=MIB, saved_bytes=4 * MIB, param_bytes=MIB, grad_bytes=MIB)))
    assert budgets == {"full": 11 * MIB, "sqrt": 15 * MIB, "checkpoint_sequential": 15 * MIB,
                       "selective:attention-core": 11 * MIB, "selective:save-matmuls": 11 * MIB}


def test_markdown_rows_and_refusals():
    row = dict(workload="gpt-small", recipe="full", budget=3 * MIB, winner="optimal #2", candidates=5, rounds=20,
               recipe_ms=50.0, optimal_ms=45.0, winner_ms=40.0, confirm_winner_ms=41.0, confirm_recipe_ms=50.0,
               confirm_optimal_ms=44.0, device="cpu")
    refused = dict(workload="mlp", recipe="sqrt", budget=MIB, refused="no plan fits")
    text = markdown([row, refused], 20, 30.0)
    assert "| gpt-small | full | 3.00 | 5 | 20 | optimal #2 | 50.0 / 45.0 / 40.0 | 0.80 | 0.82 | 0.93 |" in text
    assert "| mlp | sqrt | 1.00 | | | refused: no plan fits |" in text
    assert "at most 20 timed steps per candidate or 30 s of rounds" in text
