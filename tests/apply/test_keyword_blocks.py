"""Blocks the model calls with keyword arguments only (Hugging Face's attention and MLP modules:
``self_attn(hidden_states=h, ...)``): their first tensor keyword argument goes through the
checkpoint, and the forward gets it back by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import remat
from remat.checkpointing.region import call_with_first, first_argument
from remat.plan.planners import make_plan
from remat.plan.types import Segment

WIDTH, ROWS = 8, 4


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, *, hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.fc(hidden)) * scale


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(hidden=self.norm(x), scale=0.5)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _model():
    torch.manual_seed(0)
    return _Model(), torch.randn(ROWS, WIDTH)


def test_the_first_argument_is_the_first_positional_one_or_the_first_tensor_keyword() -> None:
    x, y = torch.ones(1), torch.zeros(1)
    assert first_argument((x, 2), {"k": y}) == (x, (2,), {"k": y}, None)
    first, extra, rest, key = first_argument((), {"scale": 0.5, "hidden": x, "mask": y})
    assert (first is x, extra, rest, key) == (True, (), {"scale": 0.5, "mask": y}, "hidden")
    assert call_with_first(lambda *a, **k: (a, k), x, (), {"scale": 0.5}, "hidden") == ((), {"hidden": x, "scale": 0.5})
    with pytest.raises(TypeError, match=r"no positional argument and no tensor among its keyword arguments \(\['scale'\]\)"):
        first_argument((), {"scale": 0.5})


def test_keyword_called_blocks_recompute_and_run_selective_as_planned() -> None:
    """The inner modules as blocks (called ``inner(hidden=..., scale=0.5)``): every strategy the
    planners make runs, with bit-identical gradients, the replays counted as planned and the peak
    predicted to the byte."""
    model, x = _model()
    prof = remat.profile(model, x, blocks="layers.*.inner", repeats=1)
    assert [b.name for b in prof.blocks] == ["layers.0.inner", "layers.1.inner", "layers.2.inner"]
    assert all(not b.unavailable for b in prof.blocks)
    for strategy in ("full", "selective:save-matmuls"):
        plan = remat.plan(prof, None, strategy)
        check = remat.verify(model, x, plan, repeats=1)
        assert check.grads_identical and check.recompute_counts_match, strategy
        assert check.measured_peak_bytes == check.predicted_peak_bytes, strategy
    floor = remat.pareto(prof)[-1]
    assert remat.verify(model, x, floor, repeats=1).measured_peak_bytes == floor.prediction.peak_bytes


def test_a_keyword_called_block_cannot_head_a_chained_segment() -> None:
    """A segment chains its blocks through their first positional argument. The planners never
    join blocks the model calls by keyword (`make_plan` refuses such a segment); a plan written
    by hand with one is refused when it runs, with the fix, and `remove_` restores the model."""
    model, x = _model()
    prof = remat.profile(model, x, blocks="layers.*.inner", repeats=1)
    chained = (Segment(start=0, stop=1, strategy="keep"), Segment(start=1, stop=3, strategy="recompute"))
    with pytest.raises(ValueError, match=r"Split the segment at block 2"):
        make_plan(prof, chained, "chained", None)
    plan = dataclasses.replace(remat.plan(prof, None, "full"), segments=chained)
    remat.apply_(model, plan)
    with pytest.raises(ValueError, match=r"block 'layers.1.inner' heads a segment of 2 blocks but was called "
                                         r"with keyword arguments only.*Plan single-block segments"):
        model(x)
    remat.remove_(model)
    assert model(x).isfinite()
