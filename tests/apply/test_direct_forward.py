"""Layers whose parent calls ``layer.forward(...)`` directly (SqueezeBERT's encoder), past every
module hook: each is a block through a call site (``layer@0``, `remat.checkpointing.callsites`),
which the direct call reaches, so it is profiled, planned, applied and verified as any other."""

import copy

import pytest
import torch
from torch import nn

import remat
from apply_helpers import assert_trained_alike
from remat.checkpointing.callsites import sites_in


class Residual(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(width, 4 * width), nn.Dropout(0.1), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(self.drop(torch.relu(self.up(x))))


class Direct(nn.Module):
    """Three layers, the first and last called through ``layer.forward(...)``, the middle one as a
    module; ``wrapped``: the last layer has an instance ``forward`` of its own (as accelerate's
    hooks set), which the parent's call reaches."""

    def __init__(self, wrapped: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Residual() for _ in range(3))
        self.head = nn.Linear(16, 3)
        if wrapped:
            last = self.layers[2]
            last.forward = _Wrapped(type(last).forward.__get__(last))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.layers[0].forward(h, scale=0.5)
        h = self.layers[1](h)
        h = self.layers[2].forward(h)
        return self.head(h)


class _Wrapped:
    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


class Called(Direct):
    """The same layers, each called as a module: the reference for the direct calls' figures."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.layers[0](h, scale=0.5)
        h = self.layers[1](h)
        h = self.layers[2](h)
        return self.head(h)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _model(wrapped: bool = False) -> tuple[Direct, torch.Tensor]:
    torch.manual_seed(0)
    return Direct(wrapped), torch.randn(4, 6, 8)


@pytest.mark.parametrize("wrapped", [False, True])
def test_layers_called_through_forward_are_planned_with_identical_gradients_and_exact_peaks(wrapped):
    model, batch = _model(wrapped)
    own = model.layers[2].__dict__.get("forward")
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.name for b in prof.blocks] == ["layers.0@0", "layers.1", "layers.2@0"]
    # the second layer takes the first's output but not its ``scale``: no segment spans the two
    assert [b.follows_previous for b in prof.blocks] == [False, False, True]
    # the profile left every layer as it was: no watch, no site
    assert [layer.__dict__.get("forward") for layer in model.layers] == [None, None, own]
    torch.manual_seed(0)
    called = Called(wrapped)
    as_modules = remat.profile(called, batch, _loss, repeats=1)
    for strategy in ("none", "full", "sqrt"):
        check = remat.verify(model, batch, remat.plan(prof, strategy=strategy), _loss, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.loss_max_abs_diff == 0.0
        assert check.recompute_counts_match
        # the figures of the same layers called as modules, to the byte (64 B over measured when
        # recomputing, in both)
        same = remat.verify(called, batch, remat.plan(as_modules, strategy=strategy), _loss, repeats=1)
        assert (check.measured_peak_bytes, check.predicted_peak_bytes) == (same.measured_peak_bytes,
                                                                           same.predicted_peak_bytes)
        assert check.measured_peak_bytes == check.predicted_peak_bytes - (0 if strategy == "none" else 64)
    full = remat.verify(model, batch, remat.plan(prof, strategy="full"), _loss, repeats=1)
    replayed = [(c.block, c.baseline_count, c.planned_count) for c in full.op_counts if c.op == "aten.addmm.default"]
    # each layer's replay runs its first matmul again and stops at the dropout's output, the last
    # tensor its backward needs (the second matmul's input)
    assert replayed == [("layers.0@0", 2, 3), ("layers.1", 2, 3), ("layers.2@0", 2, 3)]
    if wrapped:
        assert own.calls > 0  # the layer's own instance forward ran under every runtime


def test_applied_the_direct_call_runs_the_plan_and_remove_restores_every_layer():
    model, batch = _model()
    reference = copy.deepcopy(model)
    plan = remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full")
    keys = list(model.state_dict())
    remat.apply_(model, plan)
    assert sites_in(model.layers[0]) is not None and sites_in(model.layers[1]) is None
    assert list(model.state_dict()) == keys
    copied = copy.deepcopy(model)
    assert_trained_alike([model, copied, reference], batch, _loss)
    remat.remove_(model)
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_fully_shard_by_plan_refuses_layers_called_through_forward_and_says_why():
    from remat.distributed import fsdp_units

    model, batch = _model()
    plan = remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full")
    with pytest.raises(ValueError, match=r"the plan's blocks \['layers.0@0', 'layers.2@0'\] are layers the model calls "
                                         r"through layer.forward\(...\).*goes past the module hooks that an FSDP2 unit "
                                         r"gathers its weights with"):
        fsdp_units(model, plan)
