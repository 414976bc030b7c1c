"""A forward that writes its own weights (EDM2's forced weight normalisation, as Karras' U-Net
in denoising_diffusion_pytorch does: ``weight.copy_(normalize(weight))`` under no_grad in
training): a replay wrote them a second time, so every step under a plan normalised each weight
twice and training drifted from the plain run (74 parameters of a Karras U-Net after 3 steps),
with gradients still identical. The replay now starts from the weights the forward started from
and leaves them as the forward did, as it does for buffers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat


def _normalized(w: torch.Tensor) -> torch.Tensor:
    return F.normalize(w, dim=1, eps=1e-4) * math.sqrt(w.shape[1])


class MPLinear(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.copy_(_normalized(self.weight))
        return F.linear(x, _normalized(self.weight) / math.sqrt(self.weight.shape[1]))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = MPLinear(d, 4 * d), MPLinear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.silu(self.a(x)))


class Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks, self.out = nn.ModuleList(Block(d) for _ in range(3)), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("strategy", ["full", "sqrt", "selective:save-matmuls"])
def test_weights_a_forward_writes_are_written_once_per_step(strategy):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    plan = remat.plan(remat.profile(copy.deepcopy(model), x, _loss, repeats=1), strategy=strategy)
    plain, planned = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply_(planned, plan)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, planned)]
    for step in range(3):
        for m, opt in zip((plain, planned), opts):
            _loss(m(x), x).backward()
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(plain.named_parameters(), planned.parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=f"{name} after step {step}")
