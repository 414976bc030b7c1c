"""A block that keeps a tensor of its forward on itself (RecurrentGemma's RG-LRU stores its
recurrent state as ``self.recurrent_states`` on every forward, cache or not): the replay's copy
must not keep the replay's graph, and with it the recomputed saved tensors, alive."""

from __future__ import annotations

import copy
from collections import UserDict

import torch
from torch import nn

import remat
from remat.cli.profile import state_summary


class KeepsState(nn.Module):
    """A residual MLP unit that stores its hidden state on itself, as a recurrent layer keeps its
    state for generation."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.state: torch.Tensor | None = None
        self.pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        self.state = h * 2  # needs gradients: it holds the forward's graph
        self.pair = (h[:, :1], x)
        return x + self.down(h)


class Chain(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KeepsState(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class StateOnly(KeepsState):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        self.state = h * 2
        return x + self.down(h)


def _chain(block: type[KeepsState], width: int) -> Chain:
    torch.manual_seed(0)
    model = Chain(width=width)
    model.blocks = nn.ModuleList(block(width) for _ in range(4))
    return model


def test_state_a_block_keeps_on_itself_holds_no_replayed_graph() -> None:
    """Each replay's ``state`` held the replay's graph, so its tanh output and input, through the
    backward of the blocks before it: full recomputation measured 61,440 bytes (4 x 64 rows) over
    its prediction, the peak at block 0's backward with three replays held."""
    model, x = _chain(StateOnly, 16), torch.randn(64, 16)
    prof = remat.profile(model, (x,))
    for strategy in ("full", "sqrt"):
        plan = remat.plan(prof, strategy=strategy)
        ver = remat.verify(model, (x,), plan, repeats=1)
        assert ver.grads_identical and ver.recompute_counts_match
        assert ver.measured_peak_bytes == plan.prediction.peak_bytes, (strategy, ver.measured_peak_bytes,
                                                                       plan.prediction.peak_bytes)


def test_what_the_step_leaves_on_the_model_counts_in_the_optimizer_step() -> None:
    """The states of this step are live when AdamW steps (the peak here): 4 blocks x 4 rows x 256
    floats of ``state``, the tanh outputs ``pair`` keeps (a view holds its whole tensor) and the
    inputs of blocks 1-3 it keeps (block 0's is the batch, made before the step): 35,840 bytes no
    phase counted, with or without recomputation."""
    model, x = _chain(KeepsState, 64), torch.randn(4, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, (x,), optimizer=optimizer)
    assert prof.step_held_bytes == 4 * (2 * 4 * 256 * 4) + 3 * (4 * 64 * 4) == 35840
    assert "kept on the model between steps" in state_summary(prof)
    for strategy in ("none", "full", "sqrt"):
        plan = remat.plan(prof, strategy=strategy)
        ver = remat.verify(model, (x,), plan, optimizer=optimizer, repeats=1)
        assert plan.prediction.peak_phase == "optimizer" and ver.grads_identical
        assert ver.measured_peak_bytes == plan.prediction.peak_bytes, (strategy, ver.measured_peak_bytes,
                                                                       plan.prediction.peak_bytes)
    other = _chain(StateOnly, 64)
    held = remat.profile(other, (x,), optimizer=torch.optim.AdamW(other.parameters())).step_held_bytes
    assert held == 4 * 4 * 256 * 4
    plain = _chain(StateOnly, 64)
    plain.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
    assert remat.profile(plain, (x,), optimizer=torch.optim.AdamW(plain.parameters())).step_held_bytes == 0


def _stepped_with_full_recomputation(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """A copy of ``model`` before, after one backward without remat; ``model`` after one under full
    recomputation."""
    reference = copy.deepcopy(model)
    remat.apply_(model, remat.plan(remat.profile(model, (x,)), strategy="full"))
    model(x).backward()
    reference(x).backward()
    return reference


def test_the_state_after_a_step_equals_the_state_without_remat_and_holds_no_graph() -> None:
    torch.manual_seed(0)
    model, x = Chain(), torch.randn(64, 16)
    reference = _stepped_with_full_recomputation(model, x)
    for ours, theirs in zip(model.blocks, reference.blocks):
        torch.testing.assert_close(ours.state, theirs.state, rtol=0, atol=0)
        assert ours.state.grad_fn is None and all(t.grad_fn is None for t in ours.pair)
        torch.testing.assert_close(ours.up.weight.grad, theirs.up.weight.grad, rtol=0, atol=0)


class Stores(nn.Module):
    """Writes its tanh output to a mapping every layer is handed (Gemma 4's ``shared_kv_states``),
    for the layers after it to read."""

    def __init__(self, width: int, index: int) -> None:
        super().__init__()
        self.up, self.down, self.index = nn.Linear(width, width), nn.Linear(width, width), index

    def forward(self, x: torch.Tensor, shared: UserDict) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        shared[f"h{self.index}"] = h  # before the last tensor the forward saves: the replay gets here
        return x + torch.tanh(self.down(h))


class Reads(Stores):
    def forward(self, x: torch.Tensor, shared: UserDict) -> torch.Tensor:
        return x + torch.tanh(self.up(x)) * shared[f"h{self.index - 2}"]


class SharesState(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Stores(width, 0), Stores(width, 1), Reads(width, 2), Reads(width, 3)])
        self.shared: UserDict | None = None
        self.written: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shared = UserDict()
        for block in self.blocks:
            x = block(x, shared=self.shared)
        self.written = dict(self.shared)
        return x.square().mean()


def test_what_a_replay_writes_to_a_mapping_the_layers_share_is_undone() -> None:
    """A replayed storing layer wrote its recomputed output, with the replay's graph, over the
    forward's in the mapping, which the checkpoints hold to the end of the backward: a 4-layer
    Gemma 4 at full recomputation measured 3.9 % over its prediction. The replay's writes are
    undone as it ends: the mapping holds the forward's tensors again, and the gradients are
    those without remat."""
    torch.manual_seed(0)
    model, x = SharesState(), torch.randn(64, 16)
    reference = _stepped_with_full_recomputation(model, x)
    assert set(model.shared) == {"h0", "h1"}
    assert all(model.shared[key] is model.written[key] for key in model.shared)  # the forward's, not a replay's
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0)
