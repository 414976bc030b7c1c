"""Layers that run several times per step (weights shared across depths or time steps): each call
is a block of its own (``layer@i``, `remat.checkpointing.callsites`), profiled, planned, applied and
verified as any other block, the model's parameters, ``state_dict`` and module tree unchanged."""

import copy

import pytest
import torch
from torch import nn

import remat
from apply_helpers import assert_trained_alike
from remat.checkpointing.callsites import _spans, is_site, layer_of, sites_in, split_site


class Looped(nn.Module):
    """One layer applied ``steps`` times (a Universal Transformer; ALBERT's layer group)."""

    def __init__(self, steps: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layer = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1),
                                   nn.Linear(4 * width, width))
        self.head = nn.Linear(width, 3)
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(self.steps):
            h = h + self.layer(h)
        return self.head(h)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _looped() -> tuple[Looped, torch.Tensor]:
    torch.manual_seed(0)
    return Looped(), torch.randn(4, 6, 8)


class Residual(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Universal(nn.Module):
    """``x = layer(x)`` four times: the calls chain, so segments of several calls can run."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = Residual(), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = self.layer(x)
        return self.head(x)


def test_each_call_is_a_block_and_every_plan_gives_identical_gradients():
    model, batch = _looped()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.name for b in prof.blocks] == ["layer@0", "layer@1", "layer@2", "layer@3"]
    assert "forward" not in model.layer.__dict__  # the profile left the layer as it was
    sizes = {b.saved_bytes for b in prof.blocks}
    assert len(sizes) == 1 and sizes.pop() > 0  # the four calls save the same
    assert [b.timing_from for b in prof.blocks] == [0, 0, 0, 0]  # one computation: timed once, on the first call
    for plan in (remat.pareto(prof)[-1], remat.plan(prof, strategy="full")):
        check = remat.verify(model, batch, plan, _loss, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.loss_max_abs_diff == 0.0
        assert check.recompute_counts_match
        # exact but for the gradients of the shared weights: their accumulation over the calls is priced
        # a few bytes high (64 B of 54,880 for full recomputation)
        assert check.predicted_peak_bytes - 128 <= check.measured_peak_bytes <= check.predicted_peak_bytes
    replayed = [c for c in check.op_counts if c.op == "aten.addmm.default"]
    # full recomputation, counted per call: each call's replay runs its first matmul again and stops
    # at the dropout's output, the last tensor its backward needs (the second matmul's input)
    assert [(c.block, c.baseline_count, c.planned_count) for c in replayed] == [(f"layer@{i}", 2, 3) for i in range(4)]
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params


def test_segments_of_several_calls_run_from_the_first_call():
    torch.manual_seed(0)
    model, batch = Universal(), torch.randn(4, 6, 16)
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.follows_previous for b in prof.blocks] == [False, True, True, True]
    plan = remat.plan(prof, strategy="sqrt")
    assert [(s.kind, s.start, s.stop) for s in plan.segments] == [("recompute", 0, 2), ("recompute", 2, 4)]
    check = remat.verify(model, batch, plan, _loss, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match


def test_applied_the_layer_hands_each_call_to_its_site_and_remove_restores_it():
    model, batch = _looped()
    reference = copy.deepcopy(model)
    plan = remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full")
    keys = list(model.state_dict())
    remat.apply_(model, plan)
    sites = sites_in(model.layer)
    assert sites is not None and [layer_of(s) for s in sites.sites] == [model.layer] * 4
    assert all(is_site(s) and isinstance(s, nn.Sequential) for s in sites.sites)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == [
        n for n, _ in reference.named_modules()]
    copied = copy.deepcopy(model)  # an applied copy drives its own layer
    assert layer_of(sites_in(copied.layer).sites[0]) is copied.layer
    assert_trained_alike([model, copied, reference], batch, _loss)
    model.eval()  # the flag reaches the sites: they read the layer's
    assert not any(s.training for s in sites.sites)
    reference.eval()
    model.steps = reference.steps = 6  # more calls than planned: those run as the layer's own
    with torch.no_grad():
        torch.testing.assert_close(model(batch), reference(batch), rtol=0, atol=0)
    remat.remove_(model)
    assert "forward" not in model.layer.__dict__


def test_a_plan_of_calls_is_refused_by_a_model_without_that_layer_and_nothing_changes():
    model, batch = _looped()
    plan = remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full")
    other = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(ValueError, match=r"the plan names block 'layer', which Sequential does not have"):
        remat.apply_(other, plan)
    assert "forward" not in other.__dict__ and not remat.apply.api.is_applied(other)


def test_block_names_of_calls_split_back_into_the_layer_and_the_call():
    assert split_site("encoder.layer@12") == ("encoder.layer", 12)
    assert split_site("encoder.layer.0") == ("encoder.layer.0", None)
    assert split_site("odd@name@3") == ("odd@name", 3)
    assert split_site("layer@03") == ("layer@03", None)  # not a call number
    assert _spans({0, 1, 2, 5, 7, 8}) == "0-2, 5, 7-8"


def test_fully_shard_by_plan_refuses_calls_of_one_layer():
    from remat.distributed import fsdp_units

    model, batch = _looped()
    plan = remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full")
    with pytest.raises(ValueError, match=r"the plan's blocks \['layer@0', 'layer@1', 'layer@2'\] \.\.\. are calls of a "
                                         r"layer that runs several times per step"):
        fsdp_units(model, plan)


class Recurrent(nn.Module):
    """A GRU cell stepped over time, the classic chain whose activations grow with its length."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = nn.GRUCell(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 16)
        outs = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            outs.append(h)
        return self.head(torch.stack(outs, 1))


def test_a_recurrent_cell_is_planned_per_time_step():
    torch.manual_seed(0)
    model, batch = Recurrent(), torch.randn(4, 5, 8)
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.name for b in prof.blocks] == [f"cell@{t}" for t in range(5)]
    assert [b.timing_from for b in prof.blocks] == [0, 1, 1, 1, 1]  # the first step's state is zeros, no gradient
    plan = remat.plan(prof, strategy="full")
    check = remat.verify(model, batch, plan, _loss, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
    assert check.measured_peak_bytes < check.baseline_peak_bytes


def test_a_compiled_profile_leaves_the_layer_as_it_was():
    """The compiled profile hides each block from dynamo by setting its ``_call_impl``: on a call
    site that stays the site's own. Set on the layer, it outlived the profile and ran the
    original model inside `remat.verify`'s copies."""
    torch.manual_seed(0)
    model, batch = Universal(), torch.randn(4, 6, 16)
    prof = remat.profile(model, batch, _loss, repeats=1, compiled="eager")
    assert "_call_impl" not in model.layer.__dict__ and "forward" not in model.layer.__dict__
    check = remat.verify(model, batch, remat.plan(prof, strategy="sqrt"), _loss, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and not check.compiled_error


class RecurrentDepth(nn.Module):
    """A prelude and a coda that run once, a core of two layers looped three times between them
    (a recurrent-depth model): every layer and every call of the core is a block."""

    def __init__(self) -> None:
        super().__init__()
        self.prelude = nn.ModuleList(Residual() for _ in range(2))
        self.core = nn.ModuleList(Residual() for _ in range(2))
        self.coda = nn.ModuleList(Residual() for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.prelude:
            x = layer(x)
        for _ in range(3):
            for layer in self.core:
                x = layer(x)
        for layer in self.coda:
            x = layer(x)
        return self.head(x)


def test_a_looped_core_between_layers_that_run_once_is_planned_whole():
    torch.manual_seed(0)
    model, batch = RecurrentDepth(), torch.randn(4, 6, 16)
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.name for b in prof.blocks] == ["prelude.0", "prelude.1", *(f"core.{j}@{i}" for i in range(3) for j in range(2)),
                                              "coda.0", "coda.1"]
    assert [(s.name, s.start, s.stop) for s in prof.stacks] == [("prelude", 0, 2), ("core", 2, 8), ("coda", 8, 10)]
    for strategy in ("full", "sqrt"):
        plan = remat.plan(prof, strategy=strategy)
        check = remat.verify(model, batch, plan, _loss, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
        assert check.predicted_peak_bytes - 128 <= check.measured_peak_bytes <= check.predicted_peak_bytes
    assert any(seg.stop - seg.start > 1 and seg.start >= 2 for seg in plan.segments)  # √N: core calls replayed together


class WithReference(nn.Module):
    """A DPO-style step: the policy runs first under ``torch.no_grad()`` as its own reference."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Residual() for _ in range(2))

    def policy(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = self.policy(x)
        return self.policy(x) - reference


def test_calls_without_gradients_are_counted_and_the_others_planned():
    torch.manual_seed(0)
    model, batch = WithReference(), torch.randn(4, 6, 16)
    prof = remat.profile(model, batch, _loss, repeats=1)
    assert [b.name for b in prof.blocks] == ["layers.0@1", "layers.1@1"]
    check = remat.verify(model, batch, remat.plan(prof, strategy="full"), _loss, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
    assert check.predicted_peak_bytes - 128 <= check.measured_peak_bytes <= check.predicted_peak_bytes


def test_a_call_with_gradients_the_plan_has_no_block_for_is_named_in_a_warning():
    model, batch = _looped()
    remat.apply_(model, remat.plan(remat.profile(model, batch, _loss, repeats=1), strategy="full"))
    model.steps = 5
    with pytest.warns(UserWarning, match=r"call 4 of Sequential in this forward runs with gradients, but the plan has "
                                         r"blocks for its calls 0-3 only"):
        _loss(model(batch), batch).backward()
    remat.remove_(model)
