"""`benchmarks.segment_calls`: its segmented models train as the model does, and a tiny run reports
every variant."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import segment_calls  # noqa: E402
from remat._batch import forward_backward  # noqa: E402
from remat.models import load_target  # noqa: E402

TINY = dict(num_blocks=4, channels=4, image_size=8, batch_size=2)


def test_segments_of_every_length_give_the_gradients_of_the_model() -> None:
    built = load_target("convnet", seed=0, **TINY)
    reference = copy.deepcopy(built.model)
    forward_backward(reference, built.batch, built.loss_fn)
    for k in (1, 2, 4):
        model = segment_calls.segmented(built.model, k)
        assert [len(s.blocks) for s in model.blocks] == [k] * (4 // k)
        forward_backward(model, built.batch, built.loss_fn)
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=f"{name}, {k} a segment")


def test_a_tiny_run_times_every_variant_and_reports_the_profile() -> None:
    row = segment_calls.measure("convnet", TINY, "cpu", rounds=1, warmup=1)
    assert list(row["measured_ms"]) == ["none", "torch, 1 a segment (4 calls)", "torch, 2 a segment (2 calls)",
                                        "torch, 4 a segment (1 calls)", "remat full", "remat sqrt"]
    assert all(ms > 0 for ms in row["measured_ms"].values())
    assert set(row["predicted_ms"]) == {"none", "full", "sqrt"} and row["blocks"] == 4
    assert "| remat sqrt |" in segment_calls.markdown([row], "cpu", 1)
