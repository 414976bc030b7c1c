"""A trainable stack whose output never reaches the loss (a tokenizer whose output becomes integer
codes) runs no backward, and its blocks are kept; its graph lives as long as the model's code
holds the stack's output, here a variable held to the forward's end, so what those blocks saved
is live beside the forward of every block after them, whatever their plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from exact_plans import assert_plans_exact

B, T, D = 2, 256, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class OffPathTokenizer(nn.Module):
    """Three tokenizer blocks off the loss path (their output only feeds an argmin) before four
    layers on it; ``held``: the tokenizer's output stays in a variable to the forward's end."""

    def __init__(self, held: bool) -> None:
        super().__init__()
        self.held = held
        self.inp, self.codebook, self.embed = nn.Linear(16, D), nn.Parameter(torch.randn(64, D)), nn.Embedding(64, D)
        self.tokenizer = nn.ModuleList(Block() for _ in range(3))
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        t = h
        for block in self.tokenizer:
            t = block(t)
        h = h + self.embed((t @ self.codebook.t()).argmin(-1))
        if not self.held:
            del t
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


# what one tokenizer block saves: its input and LayerNorm's output (fc1's input), LayerNorm's
# mean and rstd, fc1's output (GELU's input) and GELU's output (fc2's input), fp32
BLOCK_SAVED = (B * T * D + B * T * D + 2 * B * T + B * T * 4 * D + B * T * 4 * D) * 4


def test_an_unreached_stacks_graph_is_priced_beside_every_later_forward() -> None:
    torch.manual_seed(0)
    model, x = OffPathTokenizer(held=True), torch.randn(B, T, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, (x,), optimizer=optimizer)
    assert [b.name for b in prof.blocks] == [*(f"tokenizer.{i}" for i in range(3)), *(f"layers.{i}" for i in range(4))]
    assert BLOCK_SAVED == 659456
    assert [b.saved_bytes for b in prof.blocks[:3]] == [0, 0, 0]  # no backward: nothing kept for one
    assert [b.unreached_fwd_bytes for b in prof.blocks] == [0, BLOCK_SAVED, 2 * BLOCK_SAVED] + [3 * BLOCK_SAVED] * 4
    # full recomputation peaked at the last layer's forward 16.7 % above its prediction before
    assert_plans_exact(model, (x,), prof, optimizer)


def test_an_unreached_graph_freed_before_the_next_block_costs_it_nothing() -> None:
    torch.manual_seed(0)
    model, x = OffPathTokenizer(held=False), torch.randn(B, T, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, (x,), optimizer=optimizer)
    assert [b.unreached_fwd_bytes for b in prof.blocks] == [0, BLOCK_SAVED, 2 * BLOCK_SAVED] + [0] * 4
    # the code between the tokenizer and the first layer ran with the whole graph live, and
    # freed it: measured above what is live as the first layer starts, it counts it
    assert prof.blocks[3].between_fwd_peak_bytes >= 3 * BLOCK_SAVED
    assert_plans_exact(model, (x,), prof, optimizer, least=False)


class PreTokenizer(nn.Module):
    """The tokenizer in the part before the first block (two linears, no stack), its output kept
    in a variable to the forward's end, as Chameleon's VQ image tokenizer runs."""

    def __init__(self, head: bool = True) -> None:
        super().__init__()
        self.inp, self.codebook, self.embed = nn.Linear(16, D), nn.Parameter(torch.randn(64, D)), nn.Embedding(64, D)
        self.tok_in, self.tok_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 10) if head else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        t = self.tok_out(torch.relu(self.tok_in(h)))
        h = h + self.embed((t @ self.codebook.t()).argmin(-1))
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("head", [True, False])
def test_what_the_pre_part_saved_on_a_graph_off_the_loss_path_counts_in_the_forward_only(head: bool) -> None:
    """Without a head the step peaks in the loss's forward, with the tokenizer's graph still live
    (4 bytes under before: the mean's output)."""
    torch.manual_seed(0)
    model, x = PreTokenizer(head), torch.randn(B, T, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, (x,), optimizer=optimizer)
    # tok_in saves its input (the input linear's output); ReLU its output, which tok_out saves
    # too; the codebook product saves t: dead when the forward returns
    dead = (B * T * D + B * T * 4 * D + B * T * D) * 4
    assert [b.unreached_fwd_bytes for b in prof.blocks] == [dead] * 3
    # what stays for the backward: the input linear saves the batch (not counted: the caller's),
    # the embedding its integer indices (int64)
    assert prof.fixed_pre_saved_bytes == B * T * 8
    # before, the tokenizer's graph was held through the whole backward: full 16 % over
    assert_plans_exact(model, (x,), prof, optimizer, least=False)
