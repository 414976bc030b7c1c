"""verify: a NaN or an Inf in either run (loss, outputs, parameter gradients) is a difference,
reported with the run and the tensor; never "identical"."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import remat
from remat.apply.api import is_applied
from remat.measure.fingerprint import fingerprint
from remat.plan.types import Plan, Prediction, Segment
from remat.verify import _max_abs_diff
from remat.verify_types import Verification

PREDICTION = Prediction(
    peak_bytes=1, step_ms=1.0, extra_flops=0, extra_ms=0.0, model_state_bytes=0, fixed_bytes=0,
    retained_bytes=(), peak_block=-1, peak_phase="block", working_bytes=0,
)


class Poisoned(nn.Module):
    """A linear block whose calls number ``poison_calls`` (1-based, counted per copy) return
    ``value`` everywhere: with ``{2}`` and a recompute plan, the replay in backward is poisoned."""

    def __init__(self, poison_calls: set[int], value: float, positive: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.poison_calls, self.value, self.calls, self.positive = poison_calls, value, 0, positive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.positive:
            x = x.abs() + 1
        if self.calls in self.poison_calls:  # saved by fc (for its weight's gradient)
            x = x * self.value
        return self.fc(x) if self.positive else torch.tanh(self.fc(x))


def _setup(poison_calls: set[int], value: float, strategy: str = "recompute", positive: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), Poisoned(poison_calls, value, positive)]
    model = nn.Sequential(*layers) if positive else nn.Sequential(*layers, nn.Linear(4, 4))
    batch = torch.randn(2, 4)
    plan = Plan(segments=(Segment(start=0, stop=1, strategy=strategy),), block_names=("1",),
                strategy_name="test", budget_bytes=None, prediction=PREDICTION,
                fingerprint=fingerprint(model, batch))
    return model, batch, plan


def _loss(output, batch):
    return output.square().mean()


def _run(poison_calls: set[int], value: float, strategy: str = "recompute", positive: bool = False) -> Verification:
    model, batch, plan = _setup(poison_calls, value, strategy, positive)
    before = copy.deepcopy(model.state_dict())
    loss = (lambda output, batch: output.sum()) if positive else _loss
    v = remat.verify(model, batch, plan, loss, repeats=1)
    assert not is_applied(model)
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    return v


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_replay_that_yields_nan_or_inf_is_a_difference(value):
    v = _run({2}, value)
    assert not v.grads_identical and not v.ok
    assert v.grad_max_abs_diff == math.inf
    assert v.nonfinite and all(line.startswith("planned run: gradient of") for line in v.nonfinite)
    # an infinite input to fc meets weights of both signs: inf - inf, so NaN gradients either way
    assert "planned run: gradient of 1.fc.weight holds 16 NaN and 0 Inf of 16 values" in v.nonfinite
    assert "planned run: gradient of 0.bias holds 4 NaN and 0 Inf of 4 values" in v.nonfinite
    assert not any(line.startswith("baseline") for line in v.nonfinite)


def test_nan_in_both_runs_is_reported_not_identical():
    """Poisoning the first call of each copy: both runs' outputs, loss and gradients are NaN,
    bit for bit alike; still a difference, with both runs named."""
    v = _run({1}, math.nan, strategy="keep")
    assert not v.grads_identical and not v.ok
    assert v.loss_max_abs_diff == v.output_max_abs_diff == v.grad_max_abs_diff == math.inf
    runs = {line.split(":", 1)[0] for line in v.nonfinite}
    assert runs == {"baseline run", "planned run"}
    assert "baseline run: loss  holds 1 NaN and 0 Inf of 1 values" in v.nonfinite
    assert Verification.from_json(v.to_json()) == v


def test_an_inf_in_one_gradient_is_a_difference():
    """The replay's Inf reaches one gradient alone, as Inf: fc's weight gradient is g^T x with
    x all +inf and g = 1 (the loss is the sum of fc's outputs); backward runs the forward's graph,
    so nothing else sees it."""
    v = _run({2}, math.inf, positive=True)
    assert not v.grads_identical and not v.ok and v.grad_max_abs_diff == math.inf
    assert v.nonfinite == ("planned run: gradient of 1.fc.weight holds 0 NaN and 16 Inf of 16 values",)


def test_finite_runs_report_nothing():
    v = _run(set(), 1.0)
    assert v.grads_identical and v.ok and v.nonfinite == ()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_max_abs_diff_of_nonfinite_values_is_infinite(bad):
    a = torch.tensor([1.0, bad])
    assert _max_abs_diff([a], [a.clone()]) == math.inf
    assert _max_abs_diff([torch.tensor([1.0, 2.0])], [a]) == math.inf
    assert _max_abs_diff([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 2.5])]) == 0.5


def test_reports_name_the_nonfinite_tensor():
    from remat.report.summary import _measured
    from remat.report.tables import _grad_verdict

    v = _run({2}, math.nan)
    assert _grad_verdict(v).startswith("DIFFER: NaN or Inf in 4 tensor(s), first: planned run: gradient of 0.weight")
    assert "gradients DIFFER: NaN or Inf in 4 tensor(s)" in _measured(v, None)
