"""Tensors handed to the blocks inside a dict: ZAYA passes each layer ``attention_mask={"causal":
mask, "conv": mask}``. A checkpoint of a layer holds the dict, and with it the mask, to its
replay; no op saves the mask (it is added to the scores), so nothing else holds it past the
forward. Unseen, ZAYA's full recomputation measured 2,048 bytes (its causal mask) above its
prediction."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import remat
from exact_plans import assert_plans_exact
from remat.plan.planners import make_plan
from remat.plan.types import Segment

B, S, D = 2, 16, 8
MASK = B * S * S * 4  # float32 (B, 1, S, S)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)).unsqueeze(1) + masks["causal"]
        return x + self.out(scores.softmax(-1).squeeze(1) @ v)


class Net(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(x.shape[0], 1, S, S)
        masks = {"causal": torch.where(allowed, 0.0, -1e4)}
        for layer in self.layers:
            x = layer(x, masks)
        return x


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def test_a_mask_handed_on_in_a_dict_is_held_by_the_checkpoints_that_take_it() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(B, S, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt, repeats=1)
    first = {arg.argument: arg for arg in prof.blocks[0].inputs}
    mask = first["args[1]<map>['causal']"]
    assert (mask.storage_bytes, mask.source, mask.counted) == (MASK, "shared", "shared")
    assert [b.shared_entry_bytes for b in prof.blocks] == [MASK, 0, 0, 0]
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)
    # every split of the four layers into runs, single layers kept or recomputed
    for cuts in itertools.product((False, True), repeat=3):
        bounds = [0] + [i for i, cut in enumerate(cuts, 1) if cut] + [4]
        runs = list(zip(bounds, bounds[1:]))
        singles = [r for r in runs if r[1] - r[0] == 1]
        for flips in itertools.product(("keep", "recompute"), repeat=len(singles)):
            strategy = dict(zip(singles, flips))
            segments = tuple(Segment(start=a, stop=b, strategy=strategy.get((a, b), "recompute")) for a, b in runs)
            plan = make_plan(prof, segments, "layout", None)
            ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
            assert ver.grads_identical, segments
            assert ver.measured_peak_bytes == plan.prediction.peak_bytes, (segments, ver.measured_peak_bytes,
                                                                           plan.prediction.peak_bytes)
