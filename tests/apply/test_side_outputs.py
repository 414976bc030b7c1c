"""A side output computed from each block's output before the next block runs (Hiera's rerolled
hidden states for its multi-scale decoder): the next block and the side code both add into the
gradient of that output. Run in one recompute segment with the next block, the side code ran
after it, the two sums came in the other order: gradients 1 ulp apart (5.96e-08 in float32 on
this toy, ``grads_identical`` False) and the side code's ops counted in the wrong block. No
segment spans such a pair; side code after the next block (a neck reading every layer) joins."""

from __future__ import annotations

import pytest
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


def _reroll(x: torch.Tensor) -> torch.Tensor:
    return x.view(2, 4, 4, D).permute(0, 3, 1, 2).contiguous().view(2, D, 16)  # views, then a copy


class Net(nn.Module):
    """``side``: "between", each block's output rerolled before the next block runs; "after",
    every output rerolled once the stack has run (a neck reading every layer, DPT's); None."""

    def __init__(self, side: str | None) -> None:
        super().__init__()
        self.side = side
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(_reroll(x) if self.side == "between" else x)
        return x, [_reroll(o) for o in outs] if self.side == "after" else outs if self.side else []


def _loss(out: tuple[torch.Tensor, list[torch.Tensor]], batch: torch.Tensor) -> torch.Tensor:
    return out[0].pow(2).mean() + sum(s.pow(2).mean() for s in out[1])


def _profile(side: str | None):
    torch.manual_seed(0)
    model, x = Net(side), torch.randn(2, 16, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, x, opt, remat.profile(model, x, _loss, opt)


def test_a_block_whose_output_side_code_reads_is_not_joined_to_the_next() -> None:
    model, x, opt, prof = _profile(side="between")
    # the last block has no next block to join
    assert [b.output_read_aside for b in prof.blocks] == [True, True, True, False]
    assert joins(prof) == (False, False, False)
    assert "the code between them reads the previous block's output" in break_reason(prof.blocks[0], prof.blocks[1])
    plan = remat.plan(prof, strategy="sqrt")  # segments of two blocks before
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
    assert ver.grads_identical and ver.recompute_counts_match
    assert ver.measured_peak_bytes == ver.predicted_peak_bytes


@pytest.mark.parametrize("side", [None, "after"])
def test_without_side_code_between_them_the_blocks_join(side: str | None) -> None:
    """Read after the next block has run, in one segment or not, the output's gradient sums in
    the same order: the blocks join."""
    model, x, opt, prof = _profile(side=side)
    assert [b.output_read_aside for b in prof.blocks] == [False] * 4
    assert joins(prof) == (True, True, True)
    plan = remat.plan(prof, strategy="sqrt")
    assert [(s.start, s.stop) for s in plan.segments] == [(0, 2), (2, 4)]
    ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
    assert ver.grads_identical and ver.recompute_counts_match
