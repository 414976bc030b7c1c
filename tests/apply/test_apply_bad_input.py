"""apply_ with bad plans: each is refused before anything changes (state_dict, every forward,
the output), a step that fails midway is undone, and remove_ always restores the model."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from apply_helpers import LinearReluBlock, make_plan, seg
from remat.apply.api import apply_, is_applied, remove_
from remat.apply.runtime import BlockForward
from remat.checkpointing.caches import CacheOff
from remat.measure.fingerprint import block_names_hash, fingerprint
from remat.plan.types import Plan

WIDTH = 8


class Toy(nn.Module):
    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LinearReluBlock(WIDTH) for _ in range(num_blocks))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


NAMES = ["layers.0", "layers.1", "layers.2", "layers.3"]


def _toy():
    torch.manual_seed(0)
    return Toy(), torch.randn(3, WIDTH)


def _snapshot(model: nn.Module, batch: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model(batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: nn.Module, batch: torch.Tensor, before) -> None:
    assert not is_applied(model)
    assert all("forward" not in m.__dict__ for m in model.modules()), "a forward was left behind"
    assert not any(m._forward_pre_hooks for m in model.modules())
    loss, grads, state = _snapshot(model, batch)
    assert torch.equal(loss, before[0])
    for got, want in zip(grads, before[1], strict=True):
        assert torch.equal(got, want)
    assert state.keys() == before[2].keys() and all(torch.equal(state[k], before[2][k]) for k in state)


def _forced(plan: Plan, **changes) -> Plan:
    """A plan with ``changes`` that its own checks would refuse (as a hand-edited object could be)."""
    forced = copy.copy(plan)
    for name, value in changes.items():
        object.__setattr__(forced, name, value)
    return forced


def _refused(model, batch, plan, match, **options) -> None:
    before = _snapshot(model, batch)
    with pytest.raises(ValueError, match=match):
        apply_(model, plan, **options)
    _assert_untouched(model, batch, before)
    with pytest.raises(ValueError, match="has no remat plan applied; nothing to remove"):
        remove_(model)
    _assert_untouched(model, batch, before)


@pytest.mark.parametrize(("names", "match"), [
    (["layers.0", "layers.0", "layers.2", "layers.3"], r"block_names\[1\] 'layers\.0' appears twice"),
    (["", "layers.1", "layers.2", "layers.3"], r"block_names\[0\] is ''; a block name is the qualified name"),
    (["layers", "layers.1", "layers.2", "layers.3"], r"block 'layers\.1' lies inside its block 'layers'"),
    (["layers.0", "layers.0.fc", "layers.2", "layers.3"], r"block 'layers\.0\.fc' lies inside its block 'layers\.0'"),
    (["layers.0", "layers.1", "layers.2", "layers.9"], r"names block 'layers\.9', which Toy does not have"),
])
def test_block_names_that_are_not_distinct_submodules_are_refused(names, match):
    """Forced past the plan's own checks (which refuse the first two already): apply_ checks again."""
    model, batch = _toy()
    plan = _forced(make_plan(model, batch, NAMES, [seg(0, 4)]), block_names=tuple(names))
    _refused(model, batch, plan, match)


def test_an_alias_of_a_block_is_the_same_module():
    model, batch = _toy()
    model.first = model.layers[0]  # named_modules() lists it once: the fingerprint is unchanged
    plan = make_plan(model, batch, ["first", "layers.1", "layers.2", "layers.0"], [seg(0, 4)])
    _refused(model, batch, plan, r"blocks 'first' and 'layers\.0' are the same module")


def test_plans_with_duplicate_or_empty_names_cannot_be_made():
    model, batch = _toy()
    for names, match in ((["layers.0", "layers.0", "layers.2", "layers.3"], "appears twice"),
                         (["", "layers.1", "layers.2", "layers.3"], "never empty")):
        with pytest.raises(ValueError, match=match):
            make_plan(model, batch, names, [seg(0, 4)])


def test_block_names_are_covered_by_the_fingerprint():
    model, batch = _toy()
    plan = dataclasses.replace(make_plan(model, batch, NAMES, [seg(0, 4)]),
                               fingerprint=fingerprint(model, batch, NAMES))
    assert plan.fingerprint.block_names_hash == block_names_hash(NAMES)
    swapped = ("layers.1", "layers.0", "layers.2", "layers.3")
    with pytest.raises(ValueError, match=r"block_names \['layers\.1', 'layers\.0', .*\] are not the blocks it was profiled"):
        dataclasses.replace(plan, block_names=swapped)
    doc = json.loads(plan.to_json())
    doc["data"]["block_names"] = list(swapped)
    with pytest.raises(ValueError, match=r"plan JSON: data \(Plan\) is inconsistent: the plan's block_names"):
        Plan.from_json(json.dumps(doc))
    _refused(model, batch, _forced(plan, block_names=swapped), "are not the blocks it was profiled")


def test_overlapping_children_are_refused_before_apply():
    """Today's silent failure: block 0 ran twice, block 1 never (its grads None)."""
    model, batch = _toy()
    plan = make_plan(model, batch, NAMES, [seg(0, 4)])
    bad = _forced(plan, segments=(_forced(plan.segments[0], children=(seg(0, 2), seg(1, 3))),))
    with pytest.raises(ValueError, match=r"must be in order without overlap; \[1, 3\) starts before 2"):
        dataclasses.replace(bad.segments[0])
    _refused(model, batch, bad, r"child segments of \[0, 4\) must be in order without overlap")


@pytest.mark.parametrize(("batch_rows", "match"), [(2, r"batch shapes was \('3x8:float32',\) when profiled, now \('2x8:float32',\)")])
def test_another_batch_is_refused(batch_rows, match):
    model, batch = _toy()
    plan = make_plan(model, batch, NAMES, [seg(0, 4)])
    before = _snapshot(model, batch)
    with pytest.raises(ValueError, match=match):
        apply_(model, plan, batch=batch[:batch_rows])
    _assert_untouched(model, batch, before)


def test_a_step_that_fails_midway_is_undone(monkeypatch):
    model, batch = _toy()
    plan = make_plan(model, batch, NAMES, [seg(0, 2), seg(2, 4, "keep")])
    before = _snapshot(model, batch)

    def broken(self):
        raise RuntimeError("hook registration failed")

    monkeypatch.setattr(CacheOff, "install", broken)
    with pytest.raises(RuntimeError, match="hook registration failed"):
        apply_(model, plan)
    monkeypatch.undo()
    _assert_untouched(model, batch, before)
    apply_(model, plan)  # and the model takes a plan afterwards
    assert isinstance(model.layers[0].__dict__["forward"], BlockForward)
    remove_(model)
    _assert_untouched(model, batch, before)


def test_remove_restores_even_after_a_forward_was_deleted_by_hand():
    model, batch = _toy()
    before = _snapshot(model, batch)
    apply_(model, make_plan(model, batch, NAMES, [seg(0, 2), seg(2, 4)]))
    del model.layers[0].forward
    remove_(model)
    _assert_untouched(model, batch, before)
    apply_(model, make_plan(model, batch, NAMES, [seg(0, 4)]))
    remove_(model)
    _assert_untouched(model, batch, before)


def test_a_data_parallel_wrapper_is_named_with_the_order_to_apply_in():
    """``apply_(DataParallel(model), plan)`` said the plan was made for another model, and
    ``remove_(wrapper)`` that nothing was applied: the plan is the wrapped model's, applied
    before wrapping (torchtitan's order) or to ``wrapper.module``."""
    model, x = _toy()
    plan = make_plan(model, x, NAMES, [seg(0, 4)])
    before = _snapshot(model, x)
    wrapper = nn.DataParallel(model)
    with pytest.raises(ValueError, match=r"DataParallel wraps the model the plan was made for .*apply the plan "
                                         r"before wrapping .*remat.apply_\(wrapper.module, plan\)"):
        apply_(wrapper, plan)
    _assert_untouched(model, x, before)
    apply_(wrapper.module, plan)
    with pytest.raises(ValueError, match=r"the model it wraps has: remat.remove_\(wrapper.module\)"):
        remove_(wrapper)
    remove_(wrapper.module)
    _assert_untouched(model, x, before)
