"""The benchmarks of this change run as documented: `benchmarks.hook_held` on the 16-block MLP and
`benchmarks.estimate_counts` on two model types."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_hook_held_counts_every_held_input_and_predicts_no_peak_low() -> None:
    from benchmarks.hook_held import PLANS, hooked

    row = hooked("mlp")
    assert row["blocks"] == 16
    assert row["held"] == 15 * 64 * 64 * 4  # each later block's input: 64 rows of 64 float32
    for plan in PLANS:
        error, grads = row[plan]
        assert error <= 0.0, (plan, error)  # measured never above the prediction
        assert grads == "bit-identical", plan


def test_estimate_counts_names_the_parameters_or_the_refusal(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from benchmarks.estimate_counts import one

    assert one("zaya", tmp_path) == "ok 8840488784"  # its first router traced apart: the model's own count
    refused = one("hrm_text", tmp_path)
    assert refused.startswith("refused ") and "copying its traced layers counts 4,392,224,256 parameters and the " \
        "model has 1,447,822,848" in refused
