"""Layouts drawn at random from the whole plan space (per-block keep and selective options,
recompute segments of up to four blocks with nested children), each run and measured: the peak
as predicted to the byte, gradients bit-identical. Four hand-written models whose dataflow the
fixed recipes never exercise: residual blocks that update the rows a mask picks (their input not
saved), a custom autograd Function keeping a tensor on its ``ctx``, DiT blocks modulated by a
conditioning vector every block takes, and Perceiver blocks cross-attending to inputs every block
reads. With the code before the runtime let a replay's nested child's output go and the model
counted the child's input as the replay holds it, and before the ``ctx`` tensors were named, 2
of the masked model's 12 layouts here and 4 of the ``ctx`` model's missed their predictions
(other draws of layouts measured up to 15 % and 11 % above them). DiT's plans that recompute its first block are predicted 128 bytes above their step, a
bound (a tensor of the conditioning path, counted once more than the step holds it)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from plan_space import region_layouts
from remat.plan.joins import joins
from remat.plan.planners import make_plan
from remat.plan.search import block_options
from remat.plan.types import Segment
from tests.measure.graph_held_models import SiLU

D = 32
LAYOUTS = 12


class MaskedRows(nn.Module):
    """Adds ``relu(lin(x))`` to the rows whose norm is above the median, in place on a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = x.norm(dim=-1)
        keep = norms > norms.median()
        out = x.clone()
        out[keep] = out[keep] + torch.relu(self.lin(x[keep]))
        return out


class CtxBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(SiLU.apply(self.a(x)))


class DiTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1 = nn.LayerNorm(D, elementwise_affine=False)
        self.n2 = nn.LayerNorm(D, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(approximate="tanh"), nn.Linear(4 * D, D))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, -1)
        h = self.n1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        return x + gate2 * self.mlp(self.n2(x) * (1 + scale2) + shift2)


class DiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(4, D, 2, 2)
        self.time = nn.Sequential(nn.Linear(16, D), nn.SiLU(), nn.Linear(D, D))
        self.blocks = nn.ModuleList(DiTBlock() for _ in range(4))
        self.final = nn.Linear(D, 16)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        angles = t[:, None] * torch.exp(-torch.arange(8) / 8)[None]
        c = self.time(torch.cat([angles.cos(), angles.sin()], -1))
        h = self.patch(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            h = block(h, c)
        return self.final(h)


class CrossBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.LayerNorm(D), nn.LayerNorm(D)
        self.cross = nn.MultiheadAttention(D, 4, batch_first=True)
        self.self_attn = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, latents: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        k = self.kv(inputs)
        latents = latents + self.cross(self.q(latents), k, k, need_weights=False)[0]
        return self.self_attn(latents)


class Perceiver(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(8, D))
        self.embed = nn.Linear(5, D)
        self.blocks = nn.ModuleList(CrossBlock() for _ in range(4))
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs, latents = self.embed(x), self.latents.expand(x.shape[0], -1, -1)
        for block in self.blocks:
            latents = block(latents, inputs)
        return self.out(latents.mean(1))


def _square(out: torch.Tensor, _batch) -> torch.Tensor:
    return out.square().mean()


def _case(name: str):
    torch.manual_seed(0)
    if name == "masked rows":
        return nn.Sequential(*(MaskedRows() for _ in range(4))), torch.randn(8, 32, D)
    if name == "ctx tensor":
        return nn.Sequential(*(CtxBlock() for _ in range(4))), torch.randn(8, 16, D)
    if name == "DiT":
        return DiT(), (torch.randn(2, 4, 8, 8), torch.rand(2) * 1000)
    return Perceiver(), torch.randn(2, 20, 5)


def _random_layout(prof, rng: random.Random) -> tuple[Segment, ...]:
    out, a, n = [], 0, prof.num_blocks
    mask = joins(prof)
    replayable = [all(kind != "recompute" for kind, _ in block.unavailable) for block in prof.blocks]
    while a < n:
        if rng.random() < 0.4 and replayable[a]:
            longest = a + 1  # a segment of up to four blocks, within the blocks that may join and run it
            while longest < min(n, a + 4) and mask[longest - 1] and replayable[longest]:
                longest += 1
            b = rng.randint(a + 1, longest)
            out.append(Segment(start=a, stop=b, strategy="recompute", children=rng.choice(list(region_layouts(a, b, (a, b))))))
            a = b
        else:
            out.append(rng.choice(block_options(prof, a)))
            a += 1
    return tuple(out)


@pytest.mark.parametrize("name", ["masked rows", "ctx tensor", "DiT", "Perceiver"])
def test_random_layouts_measure_as_predicted(name):
    model, batch = _case(name)
    prof = remat.profile(model, batch, _square, repeats=1)
    rng, checked, nested = random.Random(0), 0, 0
    for _ in range(10 * LAYOUTS):
        if checked == LAYOUTS:
            break
        try:
            plan = make_plan(prof, _random_layout(prof, rng), "layout", None)
        except ValueError:  # a segment across a break between blocks (`remat.plan.joins`)
            continue
        check = remat.verify(model, batch, plan, _square, repeats=1)
        layout = [(s.start, s.stop, s.strategy, [(c.start, c.stop) for c in s.children]) for s in plan.segments]
        assert check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match, layout
        if name == "DiT":  # plans that recompute block 0 are predicted 128 bytes (0.02 %) above their step
            assert 0 <= check.predicted_peak_bytes - check.measured_peak_bytes <= 128, layout
        else:
            assert check.measured_peak_bytes == check.predicted_peak_bytes, layout
        checked += 1
        nested += any(s.children for s in plan.segments)
    assert checked == LAYOUTS
    assert nested or name == "ctx tensor"  # its blocks join no segment


def _r(a: int, b: int, *children: Segment) -> Segment:
    return Segment(start=a, stop=b, strategy="recompute", children=children)


@pytest.mark.parametrize("segments", [
    (_r(0, 4, _r(1, 4)),),
    (_r(0, 3, _r(1, 3)), Segment(start=3, stop=4, strategy="keep")),
    (_r(0, 4, _r(1, 3, _r(2, 3)), _r(3, 4)),),
    (_r(0, 4, _r(0, 1), _r(1, 4, _r(2, 3), _r(3, 4))),),
    (_r(0, 4, _r(0, 1), _r(2, 4, _r(2, 3))),),
    (_r(0, 4, _r(1, 4, _r(1, 3, _r(1, 2)), _r(3, 4))),),
    (Segment(start=0, stop=1, strategy="keep"), _r(1, 4, _r(2, 4, _r(2, 3)))),
], ids=["child of three", "child of two", "its child after a kept block", "two deep after a child",
        "its child first", "three deep", "after a kept block"])
def test_a_nested_childs_input_lives_through_its_replay(segments):
    """Torch replays a nested checkpoint with its input as an argument, held to the replay's end:
    beside the forwards of the child's blocks after its first, and of a child of its own there
    (the masked blocks save none of their input). Counted through the first block's forward
    alone, the first four layouts measured one activation (32 KiB, 11.7-13.0 %) or half of one
    (6.5-6.6 %) over their predictions; the last three measured 32 KiB under when it was counted
    beside a child that begins the child too, whose checkpoint holds it already."""
    model, batch = _case("masked rows")
    prof = remat.profile(model, batch, _square, repeats=1)
    check = remat.verify(model, batch, make_plan(prof, segments, "layout", None), _square, repeats=1)
    assert check.grads_identical and check.recompute_counts_match
    assert check.measured_peak_bytes == check.predicted_peak_bytes
