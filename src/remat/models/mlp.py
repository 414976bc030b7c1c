"""A deep chain of identical Linear + activation blocks (the sqrt(N) scaling study model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MAX_DEPTH = 1024


@dataclass(kw_only=True, frozen=True)
class MLPConfig:
    """Sizes of the built-in MLP."""

    depth: int = 8
    """Number of Linear + activation blocks (1..1024)."""
    width: int = 256
    """Features of every layer."""
    batch_size: int = 32
    """Rows per batch."""

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth={self.depth} is out of range; allowed: 1..{MAX_DEPTH}.")
        for name in ("width", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")


class MLPBlock(nn.Module):
    """Linear followed by GELU."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class DeepMLP(nn.Module):
    """``blocks`` (an nn.ModuleList of MLPBlock) followed by a Linear read-out."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(config.width) for _ in range(config.depth))
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def reconstruction_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Mean squared error between the output and the input batch (an auto-encoder objective)."""
    return F.mse_loss(output, batch)


def make_batch(config: MLPConfig, generator: torch.Generator) -> torch.Tensor:
    """A (batch_size, width) tensor of standard normal inputs."""
    return torch.randn(config.batch_size, config.width, generator=generator)
