"""A small residual ConvNet with BatchNorm in every block.

BatchNorm updates its running statistics in forward, so a block that is recomputed in
backward would update them twice: the hard case for recomputation. With ``downsample_every=K``
the units form ResNet-like stages: every K-th unit halves the image and doubles the channels,
so each stage's activations are half the size of the stage before.
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
    downsample_every: int = 0
    """0: every unit keeps ``channels`` and the image size. K >= 1: units K, 2K, ... halve the
    height and width and double the channels (stride 2, a strided 1x1 projection on the
    shortcut): a unit's activations are half those of the stage before."""

    def __post_init__(self) -> None:
        for name in ("num_blocks", "channels", "image_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.downsample_every < 0:
            raise ValueError(f"downsample_every={self.downsample_every} must be >= 0 (0: no downsampling).")
        if self.image_size % 2 ** self.num_downsamples:
            raise ValueError(
                f"image_size={self.image_size} must be divisible by 2 ** {self.num_downsamples} "
                f"(num_blocks={self.num_blocks} with downsample_every={self.downsample_every} halves it "
                f"{self.num_downsamples} times); pick a multiple or a larger downsample_every."
            )

    @property
    def num_downsamples(self) -> int:
        """Units that halve the image."""
        return 0 if self.downsample_every == 0 else (self.num_blocks - 1) // self.downsample_every

    def unit_strides(self) -> list[int]:
        """Per unit: 2 where it downsamples, else 1."""
        k = self.downsample_every
        return [2 if k and i and i % k == 0 else 1 for i in range(self.num_blocks)]


class ResidualUnit(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut, then ReLU. The shortcut is the
    identity, or with ``stride=2`` a strided conv1x1 -> BN to ``2 * channels`` (ResNet's
    projection shortcut)."""

    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        out = channels * stride
        self.conv1 = nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = None if stride == 1 else nn.Sequential(
            nn.Conv2d(channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(skip + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    """Stem conv + BN, ``blocks`` (nn.ModuleList of ResidualUnit), global pool, linear classifier."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, config.channels, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(config.channels)
        units, channels = [], config.channels
        for stride in config.unit_strides():
            units.append(ResidualUnit(channels, stride))
            channels *= stride
        self.blocks = nn.ModuleList(units)
        self.classifier = nn.Linear(channels, NUM_CLASSES)

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
