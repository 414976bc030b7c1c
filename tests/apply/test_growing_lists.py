"""Two convolutional layouts discovery refused ("no blocks found") and a list argument the model
keeps appending to after the call.

- A DenseNet (timm's): each dense block is an ``nn.ModuleDict`` of dense layers, and it hands
  every layer the list of all feature maps so far, then appends the layer's output to that list.
  A replay saw the list as it was at the backward, longer than at the call: it concatenated more
  channels (timm's DenseNet failed, "running_mean should contain 256 elements not 248"), and a
  layer that reads the list's last item would have replayed on another tensor, silently.
- A RegNet (timm's): its stages are plain modules with their blocks added one by one as
  attributes (``b1``, ``b2``, ...), the first stages with one block."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.measure.stacks import discover

C, GROWTH = 4, 2


class DenseLayer(nn.Module):
    def __init__(self, channels: int, last: bool) -> None:
        super().__init__()
        self.last = last
        self.norm, self.conv = nn.BatchNorm2d(channels), nn.Conv2d(channels, GROWTH, 3, padding=1)
        self.drop = nn.Dropout(0.2)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        if self.last:  # reads the list's last item only (a silent wrong replay, were the list longer)
            return self.drop(self.conv(torch.relu(features[-1])))
        return self.drop(self.conv(torch.relu(self.norm(torch.cat(features, 1)))))


class DenseBlock(nn.ModuleDict):
    def __init__(self, channels: int, layers: int, last: bool) -> None:
        # reading the last item, a layer takes the block's input (the first) or a layer's output
        inputs = [(channels if i == 0 else GROWTH) if last else channels + i * GROWTH for i in range(layers)]
        super().__init__({f"layer{i}": DenseLayer(inputs[i], last) for i in range(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.block1 = DenseBlock(C, 3, last)
        self.transition = nn.Conv2d(C + 3 * GROWTH, C, 1)
        self.block2 = DenseBlock(C, 3, last)
        self.head = nn.Linear(C + 3 * GROWTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.transition(self.block1(self.stem(x))))
        return self.head(x.mean((2, 3)))


class Bottleneck(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.act = nn.Conv2d(C, C, 1), nn.Conv2d(C, C, 3, padding=1), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x + self.conv2(self.act(self.conv1(x))))


class Stage(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", Bottleneck())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.children():
            x = block(x)
        return x


class RegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.s1, self.s2, self.s3 = Stage(1), Stage(2), Stage(3)
        self.head = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.s3(self.s2(self.s1(self.stem(x)))).mean((2, 3)))


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _batch() -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_a_dense_block_and_attribute_stages_are_stacks() -> None:
    x = _batch()
    dense, reg = DenseNet(), RegNet()
    assert [name for name, _ in discover(dense, None, lambda: dense(x)).blocks] == [
        f"block{b}.layer{i}" for b in (1, 2) for i in range(3)]
    # the first stage holds one block: a stage too, as the others of its class hold more
    assert [name for name, _ in discover(reg, None, lambda: reg(x)).blocks] == ["s1.b1", "s2.b1", "s2.b2", "s3.b1",
                                                                             "s3.b2", "s3.b3"]


@pytest.mark.parametrize("last", [False, True])
def test_a_list_the_model_appends_to_after_the_call_replays_as_called(last: bool) -> None:
    torch.manual_seed(0)
    model, x = DenseNet(last), _batch()
    prof = remat.profile(model, x, _loss)
    plan = remat.plan(prof, strategy="full")
    ver = remat.verify(model, x, plan, _loss, repeats=1)
    assert ver.grads_identical and ver.output_max_abs_diff == 0.0 and ver.recompute_counts_match
    plain, applied = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply_(applied, plan)
    for m in (plain, applied):
        torch.manual_seed(3)
        _loss(m(x), x).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), applied.named_parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


class RexNetLike(nn.Module):
    """timm's RexNet and DPN: one ``Sequential`` holding the body's bottlenecks between a stem and
    a final convolution (several classes: no stack before, "no blocks found")."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), Bottleneck(), Bottleneck(), Bottleneck(),
                                      nn.Conv2d(C, C, 1))
        self.head = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def test_a_sequential_of_repeated_bottlenecks_between_a_stem_and_a_convolution_is_a_stack() -> None:
    torch.manual_seed(0)
    model, x = RexNetLike(), _batch()
    assert [name for name, _ in discover(model, None, lambda: model(x)).blocks] == [f"features.{i}" for i in range(5)]
    prof = remat.profile(model, x, _loss)
    ver = remat.verify(model, x, remat.plan(prof, strategy="full"), _loss, repeats=1)
    assert ver.grads_identical and ver.measured_peak_bytes == ver.predicted_peak_bytes
    # a pipeline of leaf layers in which one repeats, as the whole model, is a stack of its members
    # (`leaf_sequences`: the last resort, where nothing above is found); one without a repeat is none
    pipeline = nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), nn.ReLU(), nn.Conv2d(C, C, 3), nn.BatchNorm2d(C))
    assert [name for name, _ in discover(pipeline, None, lambda: pipeline(x)).blocks] == [str(i) for i in range(5)]
    pipeline = nn.Sequential(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), nn.ReLU())
    with pytest.raises(ValueError, match="no blocks found"):
        discover(pipeline, None, lambda: pipeline(x))


class OneBlockStages(nn.Module):
    """timm's resnet10t and ResNeSt-14d: four stages of one residual block each, in one-member
    ``Sequential``s (no stack of two, "no blocks found" before)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.layer1, self.layer2, self.layer3 = (nn.Sequential(Bottleneck()) for _ in range(3))
        self.head = nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer3(self.layer2(self.layer1(self.stem(x)))).mean((2, 3)))


def test_stages_of_one_block_each_are_stacks_of_one() -> None:
    torch.manual_seed(0)
    model, x = OneBlockStages(), _batch()
    assert [name for name, _ in discover(model, None, lambda: model(x)).blocks] == ["layer1.0", "layer2.0", "layer3.0"]
    prof = remat.profile(model, x, _loss)
    ver = remat.verify(model, x, remat.plan(prof, strategy="full"), _loss, repeats=1)
    assert ver.grads_identical and ver.measured_peak_bytes == ver.predicted_peak_bytes
