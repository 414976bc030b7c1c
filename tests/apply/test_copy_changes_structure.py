"""A model whose copy is not its structure to the byte (e3nn's compiled fx graphs are traced
again on ``copy.deepcopy`` and hold their constants as buffers of their own): `remat.verify`,
which steps copies, refused the very model the plan was made for ("the plan does not match this
model: model structure was ... when profiled"). It checks the model it was given; its copies are
not checked again. A traced graph's constants (``_tensor_constant0``...) do not enter the
structure's hash: `remat.apply_` refused the plan on a copy of the model it was made for (a
pristine copy kept before profiling); on a model of another structure it still does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat


class GainsBufferOnCopy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))

    def __deepcopy__(self, memo):
        new = GainsBufferOnCopy.__new__(GainsBufferOnCopy)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        new.register_buffer("_tensor_constant0", torch.zeros(1))  # what a traced copy adds
        return new


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GainsBufferOnCopy() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_verify_checks_the_model_not_its_copies():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    plan = remat.plan(remat.profile(model, x, repeats=1), strategy="full")
    check = remat.verify(model, x, plan, repeats=1)
    # the copies' own buffers, one float per layer, are state the model the plan is for has not
    assert check.grads_identical and check.measured_peak_bytes - check.predicted_peak_bytes == 3 * 4


def test_a_plan_applies_to_a_copy_whose_graph_constants_are_buffers():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    pristine = copy.deepcopy(model)
    plan = remat.plan(remat.profile(model, x, repeats=1), strategy="full")
    model(x).backward()
    remat.apply_(pristine, plan)
    pristine(x).backward()
    for got, want in zip(pristine.parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    other = copy.deepcopy(model)
    other.layers[0].register_buffer("scale", torch.ones(1))  # another structure
    with pytest.raises(ValueError, match="the plan does not match this model: model structure"):
        remat.apply_(other, plan)
