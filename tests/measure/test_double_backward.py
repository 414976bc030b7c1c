"""Steps that run a backward through a block twice: a gradient taken with ``create_graph=True``
inside the step (a physics-informed loss, a gradient penalty), and a loss_fn that runs a backward
with ``retain_graph=True`` before returning the loss (a GAN's two losses).

Torch replays a checkpointed region once per backward that reads it; the buffer guard's replay
context could be entered once only (a generator's context manager), so the second replay raised
``AttributeError: '_GeneratorContextManager' object has no attribute 'args'`` on the first step
after `apply_`, in every `verify`, and on every step of a block with a BatchNorm. Under
``create_graph=True`` a replay's tensors are saved again by the gradient's graph (a `full` plan
measured 13 % over its prediction), and torch's selective checkpointing allows one backward
through a region ("Trying to backward an extra time"): the profile says so per block."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import remat
from remat.measure.types import BACKWARD_TWICE, GRADIENT_GRAPH
from remat.plan.planners import make_plan
from remat.plan.types import Segment


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)  # a buffer the forward changes: the guard never goes idle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


class _Chain(nn.Module):
    def __init__(self, penalty: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.out = nn.Linear(16, 1)
        self.penalty = penalty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.penalty:
            x = x.detach().requires_grad_(True)
        h = x
        for block in self.blocks:
            h = block(h)
        u = self.out(h)
        if not self.penalty:
            return u
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)  # a physics-informed loss's derivative
        return du.pow(2).mean() + u.pow(2).mean()


def _two_losses(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    output.pow(2).mean().backward(retain_graph=True)  # a first loss's backward inside the loss_fn
    return output.abs().mean()


def _train(model, loss_fn, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        (loss_fn(out, x) if loss_fn else out).backward()
        opt.step()
    return model.state_dict()


def test_a_gradient_with_create_graph_leaves_every_block_keep_only_and_says_why():
    torch.manual_seed(0)
    model, x = _Chain(penalty=True), torch.randn(8, 16)
    prof = remat.profile(model, x, None, torch.optim.SGD(model.parameters(), lr=0.1), repeats=1)
    assert [dict(b.unavailable) for b in prof.blocks] == [dict.fromkeys(("recompute", "selective", "offload"), GRADIENT_GRAPH)] * 3
    with pytest.warns(UserWarning, match=r"block 'blocks.0' \(and 2 more\) cannot run 'recompute': the step differentiates "
                                         r"through its backward \(a gradient taken with create_graph=True"):
        plan = remat.plan(prof, strategy="full")
    assert plan.block_strategies() == ("keep", "keep", "keep")
    hand = tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(3))
    with pytest.raises(ValueError, match=r"block 'blocks.0' cannot run 'recompute': the step differentiates through its backward"):
        make_plan(prof, hand, "manual", None)
    result = remat.verify(model, x, plan, None, torch.optim.SGD(model.parameters(), lr=0.1), repeats=1)
    assert result.ok and result.grads_identical and abs(result.peak_error_pct) <= 1.0


def test_a_region_replayed_by_two_backward_passes_trains_as_without_remat():
    torch.manual_seed(0)
    model, x = _Chain(penalty=False), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    prof = remat.profile(model, x, _two_losses, torch.optim.SGD(model.parameters(), lr=0.1), repeats=1)
    assert [dict(b.unavailable) for b in prof.blocks] == [{"selective": BACKWARD_TWICE}] * 3
    plan = remat.plan(prof, strategy="full")
    assert plan.block_strategies() == ("recompute", "recompute", "recompute")
    result = remat.verify(model, x, plan, _two_losses, torch.optim.SGD(model.parameters(), lr=0.1), repeats=1)
    assert result.ok and result.grads_identical
    assert result.measured_peak_bytes <= result.predicted_peak_bytes  # each replay's tensors freed by its own backward
    with pytest.warns(UserWarning, match=r"cannot run 'selective:save-matmuls': the step runs a backward through it more than once"):
        assert remat.plan(prof, strategy="selective:save-matmuls").block_strategies() == ("recompute",) * 3
    remat.apply_(model, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trained = _train(model, _two_losses, x)  # the first step raised before: a second replay of the guard
    expected = _train(reference, _two_losses, x)
    assert trained.keys() == expected.keys()
    for name in expected:  # weights and the BatchNorm statistics, advanced once per step
        assert torch.equal(trained[name], expected[name]), name
    remat.remove_(model)


class _Swish(torch.autograd.Function):
    """A memory-efficient Swish: the backward recomputes under ``torch.enable_grad()``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            (x,) = ctx.saved_tensors  # unpacked with grad mode on, in an ordinary backward
            x = x.detach().requires_grad_()
            (out,) = torch.autograd.grad(x * torch.sigmoid(x), x, grad)
        return out


class _SwishBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return x + _Swish.apply(self.linear(x))


def test_a_custom_backward_under_enable_grad_keeps_every_strategy():
    """Grad mode on while a saved tensor is unpacked was read as create_graph=True: every block of
    an ordinary step was made keep-only."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[_SwishBlock() for _ in range(3)]), torch.randn(8, 16)
    prof = remat.profile(model, x, lambda out, b: out.pow(2).mean(), repeats=1)
    assert [b.unavailable for b in prof.blocks] == [()] * 3
    plan = remat.plan(prof, strategy="full")
    assert plan.block_strategies() == ("recompute",) * 3
    result = remat.verify(model, x, plan, lambda out, b: out.pow(2).mean(), repeats=1)
    assert result.ok and result.grads_identical
