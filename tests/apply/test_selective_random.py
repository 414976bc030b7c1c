"""Selective replays of blocks that draw random numbers: a draw is never cached.

The replay restores the generator as the forward found it and runs the same draws in the same
order. A cached draw is skipped there, so every draw after it took other numbers than its forward
did: SegFormer's layers (dropout, then a drop-path ``rand``, then dropout again) with the
drop-path draw cached trained on other masks in the backward, gradients off by 1e-4."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.checkpointing.cacheable import cacheable
from remat.plan.planners import make_plan
from remat.plan.policies import knapsack_frontier_union
from remat.plan.types import Segment

D = 16


def drop_path(h: torch.Tensor, keep: float = 0.8) -> torch.Tensor:
    """Stochastic depth as timm and Hugging Face write it: one draw per sample."""
    mask = keep + torch.rand((h.shape[0], 1, 1), dtype=h.dtype)
    mask.floor_()
    return h.div(keep) * mask


class Layer(nn.Module):
    """Two residual branches with dropout and stochastic depth, as SegFormer's layers: draws
    after the first drop-path draw."""

    def __init__(self) -> None:
        super().__init__()
        self.mix, self.up, self.down, self.drop = nn.Linear(D, D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.drop(self.mix(x)))
        return x + drop_path(self.drop(self.down(self.drop(torch.relu(self.up(x))))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_selective_replay_draws_what_its_forward_drew() -> None:
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(8, 4, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, None, opt)
    draws = [op.key for op in prof.blocks[1].ops if op.key.startswith("aten.rand.")]
    assert draws == ["aten.rand.default#0", "aten.rand.default#1"]
    assert not cacheable("aten.rand.default") and not cacheable("aten.bernoulli.default")
    assert cacheable("aten.mul.Tensor")  # the eager CPU dropout's output: its bernoulli_ still replays
    # the knapsack never offers a draw
    assert not any(key.startswith("aten.rand.") for _, keys in knapsack_frontier_union([prof.blocks[1]]) for key in keys)
    # a plan naming the draw (and the matmuls) replays it: the same masks, the same gradients
    saved = ("aten.rand.default#0", "aten.addmm.default#0", "aten.addmm.default#1")
    segments = tuple(Segment(start=i, stop=i + 1, strategy="keep") if i != 1 else
                     Segment(start=1, stop=2, strategy="selective:knapsack", saved_ops=saved) for i in range(3))
    check = remat.verify(model, x, make_plan(prof, segments, "layout", None), None, opt, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0, check.grad_max_abs_diff
    assert check.ok


class TimmLayer(nn.Module):
    """Dropout as one ``native_dropout`` call (its eager form on CUDA), then timm's drop path,
    which draws in place (``new_empty(...).bernoulli_()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.native_dropout(self.a(x), 0.2, True)[0]
        mask = x.new_empty((x.shape[0], 1, 1)).bernoulli_(0.8)
        return x + self.b(h) * mask / 0.8


def test_a_cached_dropout_still_draws_in_the_replay() -> None:
    """A plan may cache ``native_dropout`` (Megatron's recipe keeps the masks after the attention
    core); the replay then ran the drop path's draw from the generator the dropout's should have
    advanced, another mask: gradients off by 0.09. The cached call runs in the replay now, its
    output dropped, and the step's peak is still the prediction."""
    torch.manual_seed(0)
    model, x = nn.Sequential(TimmLayer(), TimmLayer(), TimmLayer()).train(), torch.randn(8, 4, D)

    def loss_fn(out: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, loss_fn, opt)
    assert "aten.native_dropout.default#0" in [op.key for op in prof.blocks[1].ops]
    assert cacheable("aten.native_dropout.default")
    segments = tuple(Segment(start=i, stop=i + 1, strategy="keep") if i != 1 else
                     Segment(start=1, stop=2, strategy="selective:knapsack", saved_ops=("aten.native_dropout.default#0",))
                     for i in range(3))
    plan = make_plan(prof, segments, "layout", None)
    check = remat.verify(model, x, plan, loss_fn, opt, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0, check.grad_max_abs_diff
    assert check.measured_peak_bytes == plan.prediction.peak_bytes
