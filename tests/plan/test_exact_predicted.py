"""The optimal planner against every layout priced by `predict` itself, on Hugging Face models
built from configs (random weights, batches made here).

`test_exact_measured` prices each layout by adding up its elements (`plan_space.combine`), which
is `predict` where the terms it weighs for a layout as a whole are zero. On an encoder-decoder
they are not: in T5's profile here a tensor the decoder's blocks share (512 bytes) is freed by
the code once no block of the plan holds it (`remat.plan.predict.dead_shared_bytes`), and the sums
count it to the post part, where the layouts that keep the decoder peak. And a language model whose vocabulary outweighs its layers adds the
head's strategies to the choice (`remat.plan.head`). Here every layout of the pruned per-block
options and nested segments, under every head strategy worth searching, is priced by `predict`
(`plan_space.predicted_space`), and `remat.plan` at each budget that matters must fit it and be
no slower than any of them that fits. Per block, T5's layouts keep or recompute (nested
segments) and Llama's add the named selective policies: with the knapsack's points too, the layouts
no other beats numbered from hundreds to tens of thousands between runs, as the measured times
fell (`test_exact_measured` enumerates those on smaller models).
"""

from __future__ import annotations

import random

import pytest
import torch

import remat
from plan_space import predicted_space

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

TOLERANCE_MS = 1e-9
SAMPLED_PEAKS = 16
"""Layouts whose own peak is a budget too, drawn at random (each budget plans once, 0.1-0.3 s)."""


def _t5():
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=2, feed_forward_proj="relu", relative_attention_num_buckets=32,
                                   decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    model = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.randint(1, 99, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, -1] = 0  # one padded position
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(1, 99, (2, 16))}
    # the loss as a function outside the model: the post part measured whole (no head part)
    return remat.profile(model, batch, lambda output, _: output.loss, repeats=1)


def _llama():
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 4096, (2, 64))
    return remat.profile(model, {"input_ids": ids, "labels": ids}, repeats=1)


@pytest.fixture(scope="module")
def profiles():
    torch.manual_seed(0)
    return {"t5": _t5(), "llama": _llama()}


def _budgets(space) -> list[int]:
    frontier = [peak for peak, _ in space.frontier()]
    peaks = sorted(set(space.peaks.tolist()))
    drawn = random.Random(0).sample(peaks, k=min(SAMPLED_PEAKS, len(peaks)))
    return sorted(set(drawn) | {p + d for p in frontier for d in (0, 1)})


def _named(segment) -> bool:
    """Keep and the named selective policies, not the knapsack's points."""
    return segment.strategy != "selective:knapsack"


@pytest.mark.parametrize("name", ["t5", "llama"])
def test_plan_is_the_best_predicted_layout_at_every_budget(profiles, name):
    profile = profiles[name]
    found = predicted_space(profile, options=False if name == "t5" else _named)
    space = found.space
    if name == "t5":  # the whole-layout terms reach the peak of some layouts
        assert found.combined_apart > 0
    else:  # the head is a choice: a chunked strategy among them
        assert any(head.startswith("chunked:") for head in found.heads)
    assert len(space.frontier()) >= 3
    for budget in _budgets(space):
        got = remat.plan(profile, budget=budget)
        assert got.prediction.peak_bytes <= budget
        best = space.best_ms(budget)
        assert got.prediction.step_ms <= best + TOLERANCE_MS, f"budget {budget}: {got.prediction.step_ms} ms > {best} ms"
    floor = int(space.peaks.min())
    assert remat.plan(profile, budget=floor).prediction.peak_bytes <= floor
