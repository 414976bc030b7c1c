"""A small residual ConvNet with BatchNorm in every block.

BatchNorm updates its running statistics in forward, so a block that is recomputed in
backward would update them twice: the hard case for recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10


@dataclass(kw_only=True, frozen=True)
class ConvNetConfig:
    """Sizes of the built-in ConvNet."""

    num_blocks: int = 4
    """Residual units in the body."""
    channels: int = 16
    """Channels of every residual unit."""
    image_size: int = 32
    """Height and width of the square input images."""
    batch_size: int = 8
    """Images per batch."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "channels", "image_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")


class ResidualUnit(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the identity, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    """Stem conv + BN, ``blocks`` (nn.ModuleList of ResidualUnit), global pool, linear classifier."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, config.channels, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(config.channels)
        self.blocks = nn.ModuleList(ResidualUnit(config.channels) for _ in range(config.num_blocks))
        self.classifier = nn.Linear(config.channels, NUM_CLASSES)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits; the scalar cross-entropy loss when ``labels`` is given."""
        x = F.relu(self.stem_bn(self.stem(images)))
        for block in self.blocks:
            x = block(x)
        logits = self.classifier(x.mean(dim=(2, 3)))
        return logits if labels is None else F.cross_entropy(logits, labels)


def make_batch(config: ConvNetConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: normal images of shape (batch, 3, size, size) and class ids."""
    shape = (config.batch_size, 3, config.image_size, config.image_size)
    images = torch.randn(shape, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (config.batch_size,), generator=generator)
    return images, labels
