"""Frozen weights held as a tensor subclass whose ``.to`` takes no ``copy=`` argument (QLoRA's NF4
weights, torchao's ``NF4Tensor``): the profile's snapshot of the model state raised there
(``.to() does not accept copy argument``). It copies such a tensor where it lives instead. NF4
weights cannot be compared either (no ``aten.equal``): a region's first forward, which looks for
weights the forward writes, raised, and every block of a QLoRA model was taken as unable to
recompute (no plan saved a byte). Such a weight is unchanged where its version counter is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.apply.api import applied
from remat.measure.state import StateSnapshot


class NoCopyTo(torch.Tensor):
    """A tensor whose ``.to`` refuses ``copy=``, as torchao's NF4Tensor does."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and "copy" in kwargs:
            raise RuntimeError(".to() does not accept copy argument")
        return super().__torch_function__(func, types, args, kwargs)


class NoEqual(NoCopyTo):
    """And that cannot be compared, as NF4Tensor cannot."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.equal:
            raise NotImplementedError("NF4Tensor dispatch: attempting to run aten.equal.default")
        return super().__torch_function__(func, types, args, kwargs)


class Adapted(nn.Module):
    """A frozen base weight (the subclass) and a trainable low-rank adapter beside it; ``writes``:
    the forward scales the base weight in place (as EDM2's forced weight normalisation writes its
    weights), which a replay must not do again."""

    def __init__(self, d: int = 8, kind: type = NoCopyTo, writes: bool = False) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(d, d).as_subclass(kind), requires_grad=False)
        self.a, self.b = nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False)
        self.writes = writes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.writes and self.training:
            with torch.no_grad():
                self.base.mul_(0.5)
        return torch.tanh(x @ self.base.as_subclass(torch.Tensor).t() + self.b(self.a(x)))


class Net(nn.Module):
    def __init__(self, kind: type = NoCopyTo, writes: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Adapted(kind=kind, writes=writes) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_weight_whose_to_takes_no_copy_is_snapshotted_and_restored():
    torch.manual_seed(0)
    model = Net()
    before = model.layers[0].base.detach().clone()
    snap = StateSnapshot(model, None)
    with torch.no_grad():
        model.layers[0].base.add_(1.0)
    snap.restore()
    assert torch.equal(model.layers[0].base.as_subclass(torch.Tensor), before.as_subclass(torch.Tensor))


def test_such_a_model_is_profiled_and_planned_with_the_plain_gradients():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    model(x).backward()
    plain = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    prof = remat.profile(model, x, repeats=1)
    assert [b.name for b in prof.blocks] == ["layers.0", "layers.1", "layers.2"]
    with applied(model, remat.plan(prof, strategy="full")):
        model(x).backward()
    for got, want in zip([p.grad for p in model.parameters() if p.requires_grad], plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("writes", [False, True])
def test_weights_that_cannot_be_compared_are_watched_by_their_version(writes):
    """Every block recomputes, with the plain step's gradients and, where the forward writes its
    weights, the weights it leaves (a replay writing them again would halve them once more)."""
    torch.manual_seed(0)
    model, x = Net(NoEqual, writes), torch.randn(4, 8)
    torch.manual_seed(0)
    reference = Net(NoEqual, writes)  # the same weights (the subclass has no deepcopy)
    reference(x).backward()
    prof = remat.profile(model, x, repeats=1)
    plan = remat.plan(prof, strategy="full")
    assert [s.strategy for s in plan.segments] == ["recompute"] * 3
    with applied(model, plan):
        model(x).backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor), rtol=0, atol=0, msg=name)
        if got.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0, msg=name)
