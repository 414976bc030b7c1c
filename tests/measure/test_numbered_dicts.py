"""Layers in a plain ``nn.ModuleDict`` keyed by their numbers (torchtitan's and OLMo-core's
transformers keep ``self.layers`` so, for pipeline parallelism: a stage drops the others and the
names stay): remat found no blocks there ("no blocks found"; a plain ModuleDict was taken as a
lookup by key). Numbered keys in order make it a stack; other keys stay a lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.measure.blocks import stack_lists

D, V = 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(self, keys) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layers = nn.ModuleDict({k: Block() for k in keys})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), batch.reshape(-1))


@pytest.mark.parametrize("keys", [["0", "1", "2", "3"], ["4", "5", "6"]])  # a whole model, a pipeline stage
def test_layers_in_a_dict_keyed_by_number_are_the_blocks(keys):
    torch.manual_seed(0)
    model, x = LM(keys), torch.randint(0, V, (2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt, repeats=1)
    assert [b.name for b in prof.blocks] == [f"layers.{k}" for k in keys]
    for strategy in ("full", "sqrt"):
        plan = remat.plan(prof, strategy=strategy)
        check = remat.verify(model, x, plan, _loss, opt, repeats=1)
        assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes, strategy


@pytest.mark.parametrize("keys", [["expert_0", "expert_1"], ["0", "2"], ["1", "0"], ["a", "b"]])
def test_other_dicts_stay_lookups(keys):
    assert stack_lists(LM(keys)) == []


class Levels(nn.Module):
    """MONAI SegResNetDS's decoder: a list of plain dicts, ``level["upsample"]`` then
    ``level["blocks"]``, each called once; the dicts themselves are never called."""

    def __init__(self, c: int = 4, n: int = 2) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(1, c, 3, padding=1), nn.Conv2d(c, 1, 1)
        self.down = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(n))
        self.up = nn.ModuleList(nn.ModuleDict({"upsample": nn.Conv2d(c, c, 1),
                                               "blocks": nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU())})
                                for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, skips = self.stem(x), []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = nn.functional.avg_pool2d(x, 2)
        for level in self.up:
            x = level["upsample"](nn.functional.interpolate(x, scale_factor=2.0)) + skips.pop()
            x = level["blocks"](x)
        return self.head(x).square().mean()


def test_the_members_of_a_list_of_plain_dicts_are_blocks():
    """The decoder was left in the fixed part with a warning that its members are never called."""
    torch.manual_seed(0)
    model, x = Levels(), torch.randn(2, 1, 16, 16)
    prof = remat.profile(model, x, repeats=1)
    assert [b.name for b in prof.blocks] == ["down.0", "down.1", "up.0.upsample", "up.0.blocks",
                                             "up.1.upsample", "up.1.blocks"]
    check = remat.verify(model, x, remat.plan(prof, strategy="full"), repeats=1)
    assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes
