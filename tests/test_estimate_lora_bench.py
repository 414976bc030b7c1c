"""`benchmarks.estimate_lora` runs: one model trained whole, its row and its table."""

from __future__ import annotations

from benchmarks import estimate_lora


def test_one_row_and_its_table(tmp_path) -> None:
    """GPT-2 trained whole: every product of the backward counted as torch counts the real step
    (3 x the forward: 84,148,224 FLOPs), the peaks exact."""
    row = estimate_lora.row("gpt2", None, tmp_path)
    assert row["estimated_flops"] == row["counted_flops"] == 84_148_224
    assert row["none_over"] == row["full_over"] == 0.0 and row["trained"] == row["params"] == 210_304
    assert "| gpt2 | - | 210,304 / 210,304 | 84,148,224 | 84,148,224 | 1.0000 | +0.0000 % | +0.0000 % |" in \
        estimate_lora.markdown([row])
