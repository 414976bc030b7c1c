"""Modules inside a layer as remat's blocks, on Hugging Face models built from configs: attention
modules (called with keyword arguments only: ``self_attn(hidden_states=...)``) and a mixture of
experts' MLP with its router. Every layout the fixed planners make, and the least-peak plan,
runs with the gradients of no recomputation, the replays counted as planned and the peak as
predicted, to the byte."""

from __future__ import annotations

import pytest

import remat
from zoo_models import build_zoo

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")


@pytest.mark.parametrize("name,blocks", [
    ("mistral", "model.layers.*.self_attn"),
    ("mixtral", "model.layers.*.mlp"),
    ("whisper", ["model.encoder.layers.*.self_attn", "model.decoder.layers.*.self_attn"]),
])
def test_modules_inside_a_layer_plan_and_run_exactly(name, blocks):
    zoo = build_zoo(name)
    prof = remat.profile(zoo.model, zoo.batch, zoo.loss_fn, zoo.optimizer, blocks=blocks, repeats=1)
    assert prof.num_blocks >= 2 and all(not b.unavailable for b in prof.blocks)
    plans = [remat.plan(prof, None, s) for s in ("full", "selective:save-matmuls")] + [remat.pareto(prof)[-1]]
    for plan in plans:
        check = remat.verify(zoo.model, zoo.batch, plan, zoo.loss_fn, zoo.optimizer, repeats=1)
        assert check.ok and check.recompute_counts_match, plan.strategy_name
        assert check.measured_peak_bytes == check.predicted_peak_bytes, plan.strategy_name
