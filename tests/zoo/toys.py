"""Toy models whose dataflow between blocks can be counted by hand.

Every activation is ``B x D`` fp32 (``UNIT`` bytes) unless said otherwise. Each block runs two
bias-free Linears with a tanh (or a ReLU) between: it saves its input (the first Linear), the
tanh's output (once: the second Linear saves the same storage) and whatever its last op saves.
The loss is a ``sum`` (saves nothing; its gradient is a broadcast scalar).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, D = 64, 16
UNIT = B * D * 4
"""Bytes of one activation."""


class SharedBlock(nn.Module):
    """``lin2(tanh(lin1(x)))`` times (``saved``) or plus the shared tensor ``s``: a multiply
    saves ``s``, an add saves nothing."""

    def __init__(self, saved: bool) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D, bias=False)
        self.lin2 = nn.Linear(D, D, bias=False)
        self.saved = saved

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        y = self.lin2(torch.tanh(self.lin1(x)))
        return y * s if self.saved else y + s


class SharedToy(nn.Module):
    """Three blocks, each taking the previous output and one tensor ``s`` made before them (a
    constant: like a mask, it needs no gradient)."""

    def __init__(self, saved: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList(SharedBlock(saved) for _ in range(3))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        x = self.inp(batch)
        s = torch.full((B, D), 0.5)
        for block in self.blocks:
            x = block(x, s)
        return x.sum()


class SkipLayer(nn.Module):
    """``tanh(lin2(tanh(lin1(x))))`` (+ ``skip``): it saves its output (the last tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, D, bias=False)
        self.lin2 = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.tanh(self.lin2(torch.tanh(self.lin1(x))))
        return y if skip is None else y + skip


class SkipToy(nn.Module):
    """``y0 = b0(x); y1 = b1(y0); y2 = b2(y1, skip=y0)``: block 0's output is held by block 1
    (its input, saved again) and by block 2 (a skip connection)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList(SkipLayer() for _ in range(3))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        y0 = self.blocks[0](self.inp(batch))
        y1 = self.blocks[1](y0)
        return self.blocks[2](y1, skip=y0).sum()


class PoolLayer(nn.Module):
    """``relu(lin2(relu(lin1(x))))`` over the last dimension."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(width, width, bias=False)
        self.lin2 = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin2(torch.relu(self.lin1(x))))


class PoolToy(nn.Module):
    """Block 0 on (B, 16, 8), a 2-wide max-pool between (it saves its input, block 0's output,
    and int64 indices of the maxima), block 1 on (B, 16, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList([PoolLayer(8), PoolLayer(4)])

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        y = self.blocks[0](self.inp(batch))
        return self.blocks[1](F.max_pool1d(y, 2)).sum()


def toy(name: str) -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    """Toy ``name`` (shared, shared-unsaved, skip, pool), its batch and AdamW, from seed 0."""
    torch.manual_seed(0)
    model = {"shared": lambda: SharedToy(True), "shared-unsaved": lambda: SharedToy(False),
             "skip": SkipToy, "pool": PoolToy}[name]()
    batch = torch.randn(B, 16, 8) if name == "pool" else torch.randn(B, D)
    return model, batch, torch.optim.AdamW(model.parameters())
