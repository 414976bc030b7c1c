"""Layers that return one of their inputs beside their output: a T5-style layer takes the position
bias from the layer before and returns it with its hidden states, for the next. A recompute
segment's forward holds each layer's output for the model's next call (`remat.apply.runtime`),
and the bias in it is the same storage every layer took, live once: counted in each layer's
output, a LongT5 segment of three layers was priced two biases (1.5 MiB) above its measured
forward, and a layout whose peak is that forward measured 2.1 % under its prediction. Here a bias
of one activation, made by the first layer and handed on by every layer: before, the layouts
below with two children were predicted 8,184 bytes above their step. The layers' matmuls have no
bias of their own: a child of a replay that does not begin it computes that bias's gradient (128
bytes) past the peak that its block's backward reached in the profile (a safe-side term apart)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.plan.phases import handed_bytes, segment_forward_bytes
from remat.plan.planners import make_plan
from remat.plan.types import Segment
from test_cached_inputs import _square

B, S, D = 4, 32, 32
ACT = B * S * D * 4


class Layer(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first, self.lin = first, nn.Linear(D, D, bias=False)
        self.bias_proj = nn.Linear(D, D) if first else None

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None = None):
        if self.first:
            bias = torch.tanh(self.bias_proj(h)) + 1.0
        return h + torch.relu(self.lin(h) + bias), bias  # handed on as it came


class HandingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i == 0) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = x, None
        for layer in self.layers:
            h, bias = layer(h, bias)
        return h


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = HandingModel(), torch.randn(B, S, D)
    return model, x, remat.profile(model, x, _square, repeats=1)


def test_the_bias_a_layer_returns_as_it_came_is_handed_on(case):
    _, _, prof = case
    # the first layer makes the bias (its own output); the others return the one they took
    assert [(b.output_bytes, b.output_passed_bytes) for b in prof.blocks] == [(2 * ACT, 0)] + [(2 * ACT, ACT)] * 3
    assert [handed_bytes(b) for b in prof.blocks] == [2 * ACT, ACT, ACT, ACT]


def _r(a: int, b: int, *children: Segment) -> Segment:
    return Segment(start=a, stop=b, strategy="recompute", children=children)


def _keep(i: int) -> Segment:
    return Segment(start=i, stop=i + 1, strategy="keep")


@pytest.mark.parametrize("segments", [
    (_keep(0), _r(1, 4)),
    (_keep(0), _r(1, 4, _r(1, 2), _r(2, 3))),
    (_keep(0), _r(1, 4, _r(1, 2), _r(2, 4, _r(2, 3)))),
    (_r(0, 1), _r(1, 4, _r(1, 2), _r(2, 3))),
], ids=["three", "two children", "nested", "after a recomputed block"])
def test_a_segment_of_layers_handing_the_bias_on_is_predicted_exactly(case, segments):
    model, x, prof = case
    plan = make_plan(prof, segments, "layout", None)
    check = remat.verify(model, x, plan, _square, repeats=1)
    assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes

def test_each_layer_of_a_segments_forward_adds_its_hidden_states_alone(case):
    """The segment's forward holds the outputs of its layers before the last for the model's next
    calls: each adds its hidden states; the bias is in the segment's input, where its first layer
    took it."""
    _, _, prof = case
    forwards = [segment_forward_bytes(prof, 1, stop, previous_kept=True) for stop in (2, 3, 4)]
    assert [b - a for a, b in zip(forwards, forwards[1:])] == [ACT, ACT]
