"""A model whose forward enters torch.autocast: its blocks are probed in the autocast state they
ran in, and a checkpointed region makes its weight casts without autocast's cache."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.models import build
from remat.plan.planners import make_plan
from remat.plan.types import Segment


class Autocast(nn.Module):
    """The README's wrapper: the model's forward under bfloat16 autocast."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def test_a_convolution_block_under_autocast_can_be_recomputed():
    """Probed without autocast, a convolution raised on its bfloat16 input: recompute and
    selective were marked unavailable on every block, and ``full`` quietly kept them all."""
    built = build("convnet", seed=0, num_blocks=4, channels=8, image_size=16, batch_size=2, downsample_every=2)
    model = Autocast(built.model)
    prof = remat.profile(model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    assert all(not b.unavailable for b in prof.blocks)
    plan = remat.plan(prof, strategy="full")
    assert set(plan.block_strategies()) == {"recompute"}
    v = remat.verify(model, built.batch, plan, built.loss_fn, built.optimizer, repeats=1)
    assert v.ok and v.grads_identical and v.predicted_peak_bytes == v.measured_peak_bytes


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=64, use_cache=False,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(3, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    return Autocast(model), {"input_ids": ids, "labels": ids.clone()}


def test_a_recomputed_blocks_weight_casts_are_not_held_to_the_end_of_the_forward():
    """With autocast's cache on, the casts a recomputed layer's forward made stayed cached until
    the wrapper's autocast exited, through the loss's forward: the plan recomputing layer 0
    measured one layer's bfloat16 weights (18432 bytes) over its prediction, which was its
    budget. Inside a region the casts are made uncached: every plan of the frontier exact."""
    model, batch = _llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = remat.profile(model, batch, None, optimizer, repeats=1)
    layouts = [(Segment(start=0, stop=1, strategy="recompute"), Segment(start=1, stop=2, strategy=second))
               for second in ("keep", "recompute")]  # the first measured 18432 bytes over: a layer's casts
    for plan in [*remat.pareto(prof), *(make_plan(prof, layout, "layout", None) for layout in layouts)]:
        v = remat.verify(model, batch, plan, None, optimizer, repeats=1)
        assert v.ok and v.grads_identical and v.predicted_peak_bytes == v.measured_peak_bytes, plan.block_strategies()
