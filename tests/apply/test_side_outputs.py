"""A side output computed from every block's output (Hiera's rerolled hidden states for its
multi-scale decoder, a loss on each layer): the next block and the side code both add into the
gradient of that output. Run in one recompute segment with the next block, the two sums came in
another order: gradients 1 ulp apart (5.96e-08 in float32 on this toy, ``grads_identical``
False) and the side code's ops counted in the wrong block. No segment spans such a pair."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.plan.joins import break_reason, joins

D = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, side: bool) -> None:
        super().__init__()
        self.side = side
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs = []
        for block in self.blocks:
            x = block(x)
            if self.side:  # a reroll: views, then a copy
                outs.append(x.view(2, 4, 4, D).permute(0, 3, 1, 2).contiguous().view(2, D, 16))
        return x, outs


def _loss(out: tuple[torch.Tensor, list[torch.Tensor]], batch: torch.Tensor) -> torch.Tensor:
    return out[0].pow(2).mean() + sum(s.pow(2).mean() for s in out[1])


def _profile(side: bool):
    torch.manual_seed(0)
    model, x = Net(side), torch.randn(2, 16, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, x, opt, remat.profile(model, x, _loss, opt)


def test_a_block_whose_output_side_code_reads_is_not_joined_to_the_next() -> None:
    model, x, opt, prof = _profile(side=True)
    # the last block's output is read by the loss as every block's is: no next block to join
    assert [b.output_read_aside for b in prof.blocks] == [True, True, True, False]
    assert joins(prof) == (False, False, False)
    assert "reads the previous block's output" in break_reason(prof.blocks[0], prof.blocks[1])
    plan = remat.plan(prof, strategy="sqrt")  # segments of two blocks before
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
    assert ver.grads_identical and ver.recompute_counts_match
    assert ver.measured_peak_bytes == ver.predicted_peak_bytes


def test_without_side_code_the_blocks_join() -> None:
    model, x, opt, prof = _profile(side=False)
    assert [b.output_read_aside for b in prof.blocks] == [False] * 4
    assert joins(prof) == (True, True, True)
    plan = remat.plan(prof, strategy="sqrt")
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 2), (2, 4)]
    ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
    assert ver.grads_identical and ver.recompute_counts_match
