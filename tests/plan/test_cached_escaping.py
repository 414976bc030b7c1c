"""A selective block's cached output that a later segment saves too, past the block after it: the
first layer's output goes on to the next layers through a frozen matmul (which saves none of it;
its wide output makes each layer's backward the step's peak) and to the part after the blocks,
which saves it. Caching it costs nothing while that part holds
it, but that part's backward runs first: through the backward of the layers between, the cache
alone holds it (BridgeTower's last text layer, whose output its pooler saves, caching it beside
the image layer after it: 8,192 bytes above its prediction). Counted free, the layouts that keep
the next layer measured one activation above their predictions; where the next layer's checkpoint
holds it as its input, that checkpoint counts it."""

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
_NORM = "aten.native_layer_norm.default#0"


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.lin, self.norm = nn.Linear(D, 8 * D), nn.Linear(8 * D, D), nn.LayerNorm(D)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(torch.relu(self.frozen(x))))


class Gated(nn.Module):
    """Four layers; the output is the last layer's times the first's (the product saves both)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = h = self.layers[0](x)
        for layer in self.layers[1:]:
            h = layer(h)
        return h * first


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(B, S, D)
    return model, x, remat.profile(model, x, _square, repeats=1)


def _caching_the_output(prof) -> Segment:
    caching = [o for o in block_options(prof, 0) if o.kind == "selective" and _NORM in o.saved_ops]
    assert caching
    return min(caching, key=lambda o: len(o.saved_ops))


def test_the_first_output_is_saved_by_the_post_part(case):
    _, _, prof = case
    (norm,) = [op for op in prof.blocks[0].ops if op.key == _NORM]
    assert norm.storage_escapes[0] and norm.storage_bytes[0] == ACT
    assert norm.storage_saved_from[0] == prof.num_blocks  # the post part, past the next layer
    (norm,) = [op for op in prof.blocks[3].ops if op.key == _NORM]
    assert norm.storage_saved_from[0] == prof.num_blocks  # the last layer's: the next segment


@pytest.mark.parametrize("rest", ["kept", "last recomputed", "next recomputed", "next two recomputed"])
def test_a_cache_holds_an_output_between_its_savers_backward_and_its_own(case, rest):
    model, x, prof = case
    keep = [Segment(start=i, stop=i + 1, strategy="keep") for i in range(1, 4)]
    segments = (_caching_the_output(prof), *{
        "kept": keep,
        "last recomputed": (*keep[:2], Segment(start=3, stop=4, strategy="recompute")),
        "next recomputed": (Segment(start=1, stop=2, strategy="recompute"), *keep[1:]),
        "next two recomputed": (Segment(start=1, stop=3, strategy="recompute"), keep[2]),
    }[rest])
    plan = make_plan(prof, segments, "layout", None)
    check = remat.verify(model, x, plan, _square, repeats=1)
    assert check.grads_identical and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes
