"""A plain network written as one ``nn.Sequential`` of leaf layers (``Linear, ReLU, Dropout,
Linear, ...``; VGG's features: convolutions, norms, in-place activations and pools): the
simplest model a user brings, and the one torch's ``checkpoint_sequential`` was written for, was
refused ("no blocks found": a Sequential of several classes was taken for one layer's pipeline).
Where nothing else is found, each member is a block (`remat.measure.blocks.leaf_sequences`)."""

from __future__ import annotations

import torch
from torch import nn

import remat
from exact_plans import assert_plans_exact
from remat.measure.types import WRITES_INPUT


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_a_sequential_mlp_is_planned_member_by_member() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1))], nn.Linear(32, 4))
    x = torch.randn(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt)
    assert [b.name for b in prof.blocks] == [str(i) for i in range(13)]
    assert [b.class_name for b in prof.blocks] == ["Linear", "ReLU", "Dropout"] * 4 + ["Linear"]
    # dropout's masks are replayed with the same random numbers: bit-identical gradients
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)
    least = remat.pareto(prof)[-1]
    assert least.prediction.peak_bytes < remat.plan(prof, strategy="none").prediction.peak_bytes


def test_in_place_activations_are_kept_and_say_why() -> None:
    """``ReLU(inplace=True)`` overwrites its input: replayed alone it would read what it wrote.
    Its probe says so, and the plans keep it; the convolutions and norms around it recompute."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))])
    x = torch.randn(2, 4, 8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt)
    assert [b.class_name for b in prof.blocks] == ["Conv2d", "BatchNorm2d", "ReLU"] * 3
    for block in prof.blocks:
        expected = {"recompute": WRITES_INPUT, "selective": WRITES_INPUT} if block.class_name == "ReLU" else {}
        assert {s: block.unavailable_reason(s) for s in expected} == expected
        assert block.class_name == "ReLU" or block.unavailable_reason("recompute") is None
    full = remat.plan(prof, strategy="full")
    assert [b for b, s in enumerate(full.block_strategies()) if s == "keep"] == [2, 5, 8]
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)


class VGGLike(nn.Module):
    """torchvision's layout: a ``features`` and a ``classifier`` Sequential inside a module."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 32), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def test_a_vgg_with_features_and_classifier_is_planned_member_by_member() -> None:
    """Its two Sequentials were taken as stages registered one by one (two blocks, `features`
    and `classifier`), and the least peak was no recomputation's: nothing to save."""
    torch.manual_seed(0)
    model, x = VGGLike(), torch.randn(4, 3, 16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt)
    assert [b.name for b in prof.blocks] == [f"features.{i}" for i in range(8)] + [f"classifier.{i}" for i in range(4)]
    assert remat.pareto(prof)[-1].prediction.peak_bytes < remat.plan(prof, strategy="none").prediction.peak_bytes
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)
