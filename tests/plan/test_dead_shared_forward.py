"""A tensor only kept blocks take (an encoder's mask) is held by no checkpoint: the prediction
leaves it out of the backward, but the model's code holds it to the forward's end, through the
forward of a recompute segment after those blocks, as through a kept block's. Mimi's decoder
segment was predicted 1,536 bytes under its measured peak without it, and `pareto` offered that
peak as a budget `plan` refused."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.plan.planners import make_plan
from remat.plan.types import Segment


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if scale is not None:
            h = h + scale  # an add saves neither input: no block saves the scale
        return x + self.fc2(h)


class EncoderDecoder(nn.Module):
    """Two encoder layers take a (tokens, 4 * width) scale the forward builds and holds; the two
    decoder layers after them do not, and the code between makes a large transient."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(Layer(width) for _ in range(2))
        self.decoder = nn.ModuleList(Layer(width) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(4 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self.scale).expand(x.shape[0], -1).contiguous()
        for layer in self.encoder:
            x = layer(x, scale=scale)
        with torch.no_grad():  # a transient between them (4 MiB twice): the decoder's forward is the peak
            mixed = (x.unsqueeze(1) - x.unsqueeze(0)).pow(2).sum(-1).softmax(-1) @ x
        x = x + mixed
        for layer in self.decoder:
            x = layer(x)
        return x.square().mean()


def test_a_shared_tensor_of_kept_blocks_lives_through_a_later_segments_forward() -> None:
    torch.manual_seed(0)
    model, x = EncoderDecoder(), torch.randn(256, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, (x,), optimizer=optimizer)
    segments = (Segment(start=0, stop=1, strategy="keep"), Segment(start=1, stop=2, strategy="keep"),
                Segment(start=2, stop=4, strategy="recompute"))
    plan = make_plan(prof, segments, "manual", None)
    ver = remat.verify(model, (x,), plan, optimizer=optimizer, repeats=1)
    assert ver.grads_identical
    assert plan.prediction.peak_bytes == ver.measured_peak_bytes  # 64 KiB (the scale) under before
    # every budget pareto offers, optimal meets
    for point in remat.pareto(prof):
        assert remat.plan(prof, budget=point.prediction.peak_bytes).prediction.peak_bytes <= point.prediction.peak_bytes
