"""A tensor every block reads (a mask or bias, bigger than the hidden state) that the model's code
still holds through the post part's forward: the post part's measured forward counts it, and
under recomputation so do the blocks' retained bytes, as the input a checkpoint holds. Live once,
it was counted twice: EoMT's 2-layer full recomputation, whose last layer's attention mask (1.1 MiB
against a 67 KiB hidden state) its forward holds to the return, was predicted 1,157,776 bytes
(8.2 %) above its measured peak, and so was a mask all layers share, from the first one that takes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.plan.planners import make_plan, plan
from remat.plan.types import Segment

TOKENS, WIDTH = 64, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x) + bias))  # an add saves neither input: no block saves the bias


class Biased(nn.Module):
    """Two blocks read a (tokens, 4 x width) bias the forward makes without a graph and holds to its
    return: one for both (``shared``), or one per block, made before it (EoMT's masks); the post
    part's forward makes a (tokens, 64 x width) workspace, the step's peak."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = x.repeat(1, 4)
        for i, block in enumerate(self.blocks):
            if i and not self.shared:
                bias = x.repeat(1, 4) * (i + 1)
            x = block(x, bias)
        with torch.no_grad():
            extra = x.repeat(1, 64).sum(-1, keepdim=True)
        return (x + extra).square().mean()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-block"])
def test_an_argument_the_code_holds_through_the_post_forward_counts_once(shared: bool) -> None:
    torch.manual_seed(0)
    model, x = Biased(shared), torch.randn(TOKENS, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, (x,), optimizer=optimizer, repeats=1)
    full = plan(prof, strategy="full")
    ver = remat.verify(model, (x,), full, optimizer=optimizer, repeats=1)
    assert ver.grads_identical
    # At the post part's forward peak (the workspace's sum), in bytes: the parameters 2 x (8 x 32 +
    # 32 + 32 x 8 + 8) x 4 = 4,416 (SGD holds no state, no gradient exists yet); the block 0
    # checkpoint holds the batch (not counted) and, per block, a bias of 64 x 32 x 4 = 8,192; the
    # block 1 checkpoint its input (64 x 8 x 4 = 2,048); the code holds the block 1 output (2,048) and
    # the last bias (already counted: the checkpoints hold it); the workspace 64 x 512 x 4 = 131,072
    # and its sum 64 x 4 = 256. Shared: 4,416 + 8,192 + 2,048 + 2,048 + 131,072 + 256 = 148,032;
    # per block, block 0's bias more: 156,224. The bias the code holds was counted twice before
    # (8,192 over).
    expected = 148_032 if shared else 156_224
    assert full.prediction.peak_phase == "post"
    assert ver.measured_peak_bytes == expected
    assert full.prediction.peak_bytes == expected
    # keeping the last block (its checkpoint holds no bias of its own, per block): each measured exactly
    for segments in ((("recompute", 0, 1), ("keep", 1, 2)), (("keep", 0, 1), ("recompute", 1, 2)),
                     (("keep", 0, 1), ("keep", 1, 2))):
        chosen = make_plan(prof, tuple(Segment(start=a, stop=b, strategy=s) for s, a, b in segments), "manual", None)
        check = remat.verify(model, (x,), chosen, optimizer=optimizer, repeats=1)
        assert chosen.prediction.peak_bytes == check.measured_peak_bytes, segments
