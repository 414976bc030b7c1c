"""Tiny real models whose blocks differ, profiled on this machine (``repeats=1``): the optimal
planner is checked against every layout of their measured profiles (`plan_space`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.models.registry import build


class WideBlock(nn.Module):
    """Linear to a new width, LayerNorm, GELU: blocks of an MLP whose widths vary."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.norm = nn.LayerNorm(width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.linear(x)))


class VaryingMLP(nn.Module):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WideBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(widths[-1], 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class Stage(nn.Module):
    """conv3x3 (with a stride) -> BatchNorm -> ReLU: stages whose activations shrink."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class StagedConvNet(nn.Module):
    def __init__(self, channels: tuple[int, ...], strides: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Stage(a, b, s) for a, b, s in zip(channels, channels[1:], strides))
        self.head = nn.Linear(channels[-1], 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = images
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


class AdapterBlock(nn.Module):
    """A frozen projection, then a trainable bottleneck added to the input (an adapter): the
    block saves the projection's output, never its input (the frozen matmul needs only its
    weight to pass the gradient on, the residual add nothing), so a checkpoint starting at it
    holds that input beside what it saves (`remat.measure.types.BlockProfile.unsaved_input_bytes`)."""

    def __init__(self, width: int, bottleneck: int) -> None:
        super().__init__()
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(torch.relu(self.down(self.frozen(x))))


class AdapterNet(nn.Module):
    def __init__(self, width: int, bottlenecks: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AdapterBlock(width, b) for b in bottlenecks)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class ScaledBlock(nn.Module):
    """``x + fc2(relu(fc1(2 x)))``: it saves the scaled copy, not its input, which a nested
    checkpoint's replay holds only while the child's first block runs forward again
    (`remat.plan.predict.layout_peak`)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x * 2.0)))


def scaled_profile(num_blocks: int = 6):
    """``num_blocks`` ScaledBlocks, width 32, hidden 64, batch 256, no optimizer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*(ScaledBlock(32, 64) for _ in range(num_blocks)))
        batch = torch.randn(256, 32)
    return remat.profile(model, batch, lambda out, _: out.square().mean(), repeats=1)


def adapter_model(num_blocks: int = 4) -> tuple[AdapterNet, torch.Tensor]:
    """Width 32, bottlenecks 48, 8, 24, 64 (the first ``num_blocks``), batch 64."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AdapterNet(32, (48, 8, 24, 64)[:num_blocks])
        batch = torch.randn(64, 32)
    return model, batch


def adapter_profile(num_blocks: int = 4):
    model, batch = adapter_model(num_blocks)
    return remat.profile(model, batch, repeats=1)


def mlp_profile(num_blocks: int = 6):
    """Widths 48 -> 160 -> 32 -> 96 -> 128 -> 40 -> 72 (the first ``num_blocks`` blocks), batch 256."""
    widths = (48, 160, 32, 96, 128, 40, 72)[: num_blocks + 1]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = VaryingMLP(widths)
        batch = torch.randn(256, widths[0])
    return remat.profile(model, batch, repeats=1)


def convnet_profile(num_blocks: int = 5):
    """Channels 3 -> 8 -> 16 -> 16 -> 24 -> 32, strides 1, 2, 1, 2, 1, 32x32 images, batch 8."""
    channels, strides = (3, 8, 16, 16, 24, 32)[: num_blocks + 1], (1, 2, 1, 2, 1)[:num_blocks]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = StagedConvNet(channels, strides)
        batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    return remat.profile(model, batch, repeats=1)


def gpt_profile(**sizes):
    """The built-in GPT without an optimizer (sizes as `remat.models.registry.build` takes them),
    its head part left out: these tests enumerate the blocks' layouts with the head kept, and the
    planner searches the head's strategies around that search (`tests/plan/test_plan_head.py`)."""
    built = build("gpt", optimizer="none", **sizes)
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    return dataclasses.replace(prof, head=None)
