"""A table a module keeps as a plain tensor attribute (no parameter, no buffer) and hands each block
a slice of: diffusers' QwenImage keeps its rotary table so. It lives before and after the step
whatever the plan, as a buffer does; counted as block 0's input, a checkpoint of it was priced as
holding the whole table: full recomputation of this model predicted 1,291,464 bytes and measured
242,888 (-81 %), and a budget full recomputation meets was refused."""

from __future__ import annotations

import torch
from torch import nn

import remat
from exact_plans import assert_plans_exact

D, ROWS = 32, 8192


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x * freqs)))


class KeptTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, D), nn.Linear(D, 8)
        self.table = torch.randn(ROWS, D)  # 1 MiB, kept as a plain attribute
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.table[: x.shape[1]]  # a view of the kept table
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, freqs)
        return self.out(h).pow(2).mean()


def test_a_table_kept_on_a_module_is_state_not_a_blocks_input() -> None:
    torch.manual_seed(0)
    model, x = KeptTable(), torch.randn(2, 64, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = remat.profile(model, x, lambda out, batch: out, opt)
    assert [b.entry_bytes for b in prof.blocks] == [0, 0, 0]
    assert [[arg.counted for arg in b.inputs if arg.argument == "args[1]"] for b in prof.blocks] == [["state"]] * 3
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full"), loss_fn=lambda out, batch: out)
    full = remat.plan(prof, strategy="full").prediction.peak_bytes
    assert remat.plan(prof, budget=full).prediction.peak_bytes == full
