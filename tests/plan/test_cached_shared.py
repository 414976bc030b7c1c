"""A selective block's cached output that later blocks take as a shared tensor: the first layer
makes a bias that every later layer adds to its pre-activations and none saves (LongT5's
position bias, made by its first layer and added to every layer's scores). The memory model
counts such a tensor from its first taker on (its ``shared_entry_bytes``); a cache of the op
that makes it holds it from the first layer's forward to the end of its backward. Counted in
both, LongT5's first layer caching it was predicted 786,432 bytes (6 %) over its step; here one
bias over."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.plan.planners import make_plan
from remat.plan.search import block_options
from remat.plan.types import Segment
from test_cached_inputs import _square

B, S, D = 4, 32, 32
ACT = B * S * D * 4


class Layer(nn.Module):
    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first, self.lin = first, nn.Linear(D, D)
        self.bias_proj = nn.Linear(D, D) if first else None

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None = None):
        if self.first:
            bias = torch.tanh(self.bias_proj(h)) + 1.0  # the add's output: the shared bias
        out = h + torch.relu(self.lin(h) + bias)  # an add saves neither operand
        return (out, bias) if self.first else out


class BiasModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(i == 0) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, bias = self.layers[0](x)
        for layer in self.layers[1:]:
            h = layer(h, bias)
        return h


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = BiasModel(), torch.randn(B, S, D)
    return model, x, remat.profile(model, x, _square, repeats=1)


def _caching_the_bias(prof) -> Segment:
    """Block 0's selective option that caches every call autograd saves, and the bias."""
    options = [o for o in block_options(prof, 0) if o.kind == "selective"]
    caching = [o for o in options if _BIAS in o.saved_ops]
    assert caching, [o.saved_ops for o in options]
    return max(caching, key=lambda o: len(o.saved_ops))


_BIAS = "aten.add.Tensor#0"


def test_the_bias_is_a_shared_tensor_of_the_first_layers_making(case):
    _, _, prof = case
    first = prof.blocks[0]
    (add,) = [op for op in first.ops if op.key == _BIAS]
    assert add.output_bytes == ACT and add.saved_bytes == 0
    taken = [(b.index, arg.counted) for b in prof.blocks[1:] for arg in b.inputs if arg.producer_storage == add.storage_ids[0]]
    assert taken == [(1, "shared"), (2, "earlier"), (3, "earlier")]
    assert prof.blocks[1].shared_entry_bytes == ACT


@pytest.mark.parametrize("rest", ["kept", "recomputed after", "recomputed, nested"])
def test_a_cached_shared_tensor_is_counted_once(case, rest):
    model, x, prof = case
    keep = [Segment(start=i, stop=i + 1, strategy="keep") for i in range(1, 4)]
    segments = (_caching_the_bias(prof), *{
        "kept": keep,
        "recomputed after": (Segment(start=1, stop=4, strategy="recompute"),),
        "recomputed, nested": (Segment(start=1, stop=4, strategy="recompute",
                                       children=(Segment(start=2, stop=4, strategy="recompute"),)),),
    }[rest])
    plan = make_plan(prof, segments, "layout", None)
    check = remat.verify(model, x, plan, _square, repeats=1)
    assert check.grads_identical and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes
