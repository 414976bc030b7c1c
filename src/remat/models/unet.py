"""A small U-Net (Ronneberger et al. 2015): two stacks joined by skip connections.

The down path is a list of double-conv blocks with a 2x2 max-pool between them; the up path a
list of blocks, each taking the upsampled output of the block before and the output of the down
block at the same scale (a skip connection, concatenated inside the block). The pooling saves
its input (the down block's output) and the indices of the maxima: code between blocks whose
saved bytes no recomputation of the blocks frees, the case that made the planner's prediction
15-16 % low before the profile recorded that code on its own. BatchNorm in every conv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 3


@dataclass(kw_only=True, frozen=True)
class UNetConfig:
    """Sizes of the built-in U-Net."""

    depth: int = 3
    """Blocks on the down path (the last one is the bottleneck); the up path has one fewer."""
    channels: int = 8
    """Channels of the first block; each level down doubles them."""
    image_size: int = 16
    """Height and width of the square input images (divisible by 2 ** (depth - 1))."""
    batch_size: int = 2
    """Images per batch."""

    def __post_init__(self) -> None:
        for name in ("depth", "channels", "image_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.depth < 2:
            raise ValueError(f"depth={self.depth} must be >= 2 (a down path and an up path).")
        if self.image_size % 2 ** (self.depth - 1):
            raise ValueError(
                f"image_size={self.image_size} must be divisible by 2 ** (depth - 1) = {2 ** (self.depth - 1)}: "
                "each level halves it; pick a multiple."
            )


def double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    """conv3x3 -> BN -> ReLU, twice."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(),
    )


class DownBlock(nn.Module):
    """One level of the down path: a double conv."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.convs = double_conv(in_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.convs(x)


class UpBlock(nn.Module):
    """One level of the up path: concatenate the skip connection, then a double conv."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.convs = double_conv(in_channels + skip_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.convs(torch.cat([x, skip], dim=1))


class UNet(nn.Module):
    """``down`` and ``up`` (nn.ModuleLists), max-pool and nearest upsampling between blocks, a
    1x1 conv head and per-pixel cross-entropy."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        widths = [config.channels * 2**level for level in range(config.depth)]
        self.down = nn.ModuleList(DownBlock(i, o) for i, o in zip([3, *widths[:-1]], widths))
        self.up = nn.ModuleList(UpBlock(widths[level + 1], widths[level], widths[level])
                                for level in reversed(range(config.depth - 1)))
        self.head = nn.Conv2d(widths[0], NUM_CLASSES, 1)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Per-pixel class logits; the scalar cross-entropy loss when ``labels`` is given."""
        skips = []
        x = images
        for level, block in enumerate(self.down):
            x = block(x)
            if level < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for block in self.up:
            x = block(F.interpolate(x, scale_factor=2.0, mode="nearest"), skips.pop())
        logits = self.head(x)
        return logits if labels is None else F.cross_entropy(logits, labels)


def make_batch(config: UNetConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: normal images (batch, 3, size, size) and a class per pixel."""
    images = torch.randn((config.batch_size, 3, config.image_size, config.image_size), generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (config.batch_size, config.image_size, config.image_size), generator=generator)
    return images, labels
