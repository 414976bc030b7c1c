"""Blocks that hand on two streams (PegasusX's encoder layers: tokens and global tokens attend
together, are split back, and go through one feed-forward each, weights shared) to the next
block as two arguments. The engine may run one stream's backward before the other's gradient
comes: the block's backward was seen to begin at its first output's gradient, after the second
stream had freed part of what the block saved, and every recomputing layout measured 7,808
bytes above its prediction (+1.5 % to +2.2 %). A block's backward begins at the first gradient
of any output the next block takes, or at the first read of a tensor it saved."""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

import remat
from remat.plan.types import Segment

D, S, G, B, F = 32, 16, 32, 2, 64


class TwoStream(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.gnorm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.fc1, self.fc2 = nn.Linear(D, 3 * D), nn.Linear(D, F), nn.Linear(F, D)

    def forward(self, h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.gnorm(g), self.norm(h)], 1)
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + torch.softmax(q @ k.transpose(1, 2) / 8, -1) @ v
        h, g = x[:, G:], x[:, :G]
        return h + self.fc2(torch.relu(self.fc1(h))), g + self.fc2(torch.relu(self.fc1(g)))


class Net(nn.Module):
    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.emb, self.glob = nn.Embedding(100, D), nn.Parameter(torch.randn(G, D))
        self.layers = nn.ModuleList(TwoStream() for _ in range(num_layers))
        self.out = nn.Linear(D, 100)

    def streams(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, g = self.emb(x), self.glob.expand(x.shape[0], -1, -1)
        for layer in self.layers:
            h, g = layer(h, g)
        return h, g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.streams(x)
        return self.out(h) + g.mean()


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), batch.flatten())


def _every_layout_exact(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, prof) -> None:
    """Every keep/recompute layout of one-block segments: identical gradients, peak to the byte."""
    for layout in itertools.product(("keep", "recompute"), repeat=prof.num_blocks):
        segments = tuple(Segment(start=i, stop=i + 1, strategy=s) for i, s in enumerate(layout))
        plan = dataclasses.replace(remat.plan(prof, strategy="none"), segments=segments,
                                   prediction=remat.predict(prof, segments))
        ver = remat.verify(model, x, plan, _loss, opt, repeats=1)
        assert ver.grads_identical, layout
        assert ver.measured_peak_bytes == ver.predicted_peak_bytes, (layout, ver.measured_peak_bytes - ver.predicted_peak_bytes)


def test_every_layout_of_two_stream_blocks_is_predicted_to_the_byte() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randint(0, 100, (B, S))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, x, _loss, opt)
    # each layer's backward begins with both streams' gradients live (B x S x D and B x G x D)
    assert [b.bwd_start_temp_bytes for b in prof.blocks][:2] == [B * (S + G) * D * 4 + 8] * 2
    _every_layout_exact(model, x, opt, prof)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, F), nn.Linear(F, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.relu(self.fc1(self.norm(h))))


class DropsItsGlobalStream(Net):
    """PegasusX's encoder: two-stream layers, the last layer's global tokens never returned
    (freed as the encoder returns, by the code between the two stacks); a decoder stack after."""

    def __init__(self) -> None:
        super().__init__(num_layers=2)
        self.decoder = nn.ModuleList(Decoder() for _ in range(2))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.streams(x)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        for layer in self.decoder:
            h = layer(h)
        return self.out(h)


def test_a_stream_the_code_after_the_last_layer_drops_is_not_saved_to_the_backward() -> None:
    """The last layer's global-token feed-forward saved what no backward reads: freed by the code
    right after the layer, it counts among the layer's forward temporaries, not its saved bytes
    (its ReLU's output and fc2's input, B x G x F fp32, and fc1's input, a slice of the attention
    output the layer keeps anyway). Counted saved, keeping every layer was predicted above its
    peak, and a replay of the layer, whose backward window opened below the bytes counted, below
    it (PegasusX: +5.9 % and -3.8 %). Every layout is now predicted to the byte."""
    torch.manual_seed(0)
    model, x = DropsItsGlobalStream(), torch.randint(0, 100, (B, S))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, x, _loss, opt)
    first, last = prof.blocks[0], prof.blocks[1]
    assert last.saved_bytes == first.saved_bytes - B * G * F * 4
    _every_layout_exact(model, x, opt, prof)
