"""Saved-tensor accounting: exact bytes on toys computed by hand."""

import torch
from torch import nn

from remat.measure.profile import profile
from remat.measure.saved import POST, PRE, SavedAccountant, between_name

F32 = 4


def _chain(batch_rows: int = 5) -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(batch_rows, 4)


def test_linear_relu_linear_saved_bytes_by_hand():
    model, x = _chain(5)
    blocks = list(model.named_children())
    with SavedAccountant(blocks, exclude=[*model.parameters(), x]) as acc:
        out = model(x)
        loss = out.pow(2).sum()
    # Linear(4, 8) saves its input x (the batch) and its weight (a parameter): nothing counts.
    # ReLU saves its result: 5 x 8 fp32. Linear(8, 2) saves that same storage (counted once)
    # and its weight. The loss's pow saves its input: the 5 x 2 output. sum saves no tensor.
    # Nothing runs between the blocks: those segments save nothing.
    between = {between_name(1): 0, between_name(2): 0}
    assert acc.bytes_by_segment() == {PRE: 0, "0": 0, "1": 5 * 8 * F32, "2": 0, **between, POST: 5 * 2 * F32}
    assert acc.input_bytes == {"0": 5 * 4 * F32, "1": 5 * 8 * F32, "2": 5 * 8 * F32}
    assert acc.output_bytes == {"0": 5 * 8 * F32, "1": 5 * 8 * F32, "2": 5 * 2 * F32}
    # every saver of the ReLU's output, in order: the ReLU first, then the second Linear
    relu_out = [key for key, saved in acc.saved.items() if saved.segment == "1"]
    assert [acc.savers[key] for key in relu_out] == [["1", "2"]]
    loss.backward()


def test_profile_of_chain_matches_hand_count():
    model, x = _chain(5)
    result = profile(model, x, loss_fn=lambda out, batch: out.pow(2).sum(), blocks="*", repeats=1)
    assert [b.name for b in result.blocks] == ["0", "1", "2"]
    assert [b.saved_bytes for b in result.blocks] == [0, 160, 0]
    assert (result.fixed_pre_saved_bytes, result.fixed_post_saved_bytes) == (0, 40)
    assert result.saved_bytes == 200


class _TwoViews(nn.Module):
    """Saves two views of one storage: the mul saves both halves of h."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[:, :4] * h[:, 4:]


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.views = _TwoViews()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[1](self.blocks[0](x)))
        return self.views(h).sum()


def test_storage_shared_by_two_saved_tensors_counts_once():
    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(3, 8)
    result = profile(model, x, blocks=["blocks.*"], repeats=1)
    # tanh saves its 3 x 8 result; the mul saves two views of that same storage: one count.
    # blocks.1 saves its input, the 3 x 8 output of blocks.0; blocks.0 saves only x and weights.
    assert [b.saved_bytes for b in result.blocks] == [0, 3 * 8 * F32]
    assert result.fixed_post_saved_bytes == 3 * 8 * F32


def test_weights_are_not_activations():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    x = torch.randn(2, 16)
    saved_params = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_params.append(t) or t, lambda t: t):
        model(x).sum().backward()
    weight_keys = {p.untyped_storage()._cdata for p in model.parameters()}
    assert any(t.untyped_storage()._cdata in weight_keys for t in saved_params)  # autograd saves weights
    result = profile(model, x, loss_fn=lambda out, batch: out.sum(), repeats=1)
    # blocks.0 saves x (batch) and W0; blocks.1 saves W1 and the 2 x 16 output of blocks.0.
    assert [b.saved_bytes for b in result.blocks] == [0, 2 * 16 * F32]


def test_block_sums_equal_total_minus_fixed():
    from remat.models import build

    built = build("gpt", num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
    model, batch = built.model, built.batch
    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch]}
    total: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in excluded:
            total[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*batch)
    result = profile(model, batch, optimizer=built.optimizer, repeats=1)
    block_sum = sum(b.saved_bytes for b in result.blocks)
    assert block_sum == sum(total.values()) - result.fixed_pre_saved_bytes - result.fixed_post_saved_bytes
    assert block_sum > 0 and len({b.saved_bytes for b in result.blocks}) == 1


def test_accountant_works_on_meta_device():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("meta")
    x = torch.empty(5, 4, device="meta")
    with SavedAccountant(list(model.named_children()), exclude=[*model.parameters(), x]) as acc:
        loss = model(x).pow(2).sum()  # held: a graph dropped in the forward saves nothing (its saves are taken back)
    assert acc.bytes_by_segment() == {PRE: 0, "0": 0, "1": 160, "2": 0, between_name(1): 0, between_name(2): 0, POST: 40}


class CachedTableLayer(nn.Module):
    """Scales its input by a table it builds on its first call and keeps (as BEiT caches its
    relative position index): the multiplication saves the table for backward, but the table
    is not an activation of any step after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.arange(36, dtype=torch.float32).reshape(6, 6) / 36
        return self.linear(x) * self.table


def test_a_table_cached_before_the_step_is_not_an_activation():
    import remat

    torch.manual_seed(0)
    model = nn.Sequential(CachedTableLayer(), CachedTableLayer())
    x = torch.randn(6, 6)
    loss_fn = lambda out, batch: out.square().sum()  # noqa: E731
    result = profile(model, x, loss_fn=loss_fn, blocks="*", repeats=1)
    # each block saves its linear's input (block 0's is the batch: not counted) and the linear's
    # output (for the table's gradient... none: the table needs none, so mul saves only the
    # table, which existed before the step); block 1 saves its input, block 0's output
    assert [b.saved_bytes for b in result.blocks] == [0, 6 * 6 * F32]
    for strategy in ("none", "full"):
        check = remat.verify(model, x, remat.plan(result, strategy=strategy), loss_fn, repeats=1)
        assert check.ok and check.measured_peak_bytes == check.predicted_peak_bytes, strategy


class SideBranchLayer(nn.Module):
    """Computes a side score it throws away (a diagnostic, Informer's sampled attention scores):
    ``exp`` saves its own output, so the dropped branch saves tensors the backward never sees."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.linear(x).exp()
        score = (side * side).sum()
        del side, score
        return torch.tanh(self.linear(x))


def test_saves_of_a_graph_the_forward_drops_are_not_activations():
    """Counted at their save, they are taken back when their graph dies in the forward: every
    layer saves its tanh's output, 16 x 16 floats (its linear's input is the previous layer's
    output, counted there, or the batch); the peaks measured with remat's hooks equal the model's own
    (the live tracker without hooks), so the exp outputs held by no cycle are not kept alive."""
    import remat
    from remat.measure.tracker import LiveTracker

    torch.manual_seed(0)
    model = nn.Sequential(*(SideBranchLayer() for _ in range(3)))
    x = torch.randn(16, 16)
    loss_fn = lambda out, batch: out.sum()  # noqa: E731
    row = 16 * 16 * F32
    for _ in range(3):  # the same every time, whatever addresses the allocator hands out
        result = profile(model, x, loss_fn=loss_fn, blocks="*", repeats=1)
        assert [b.saved_bytes for b in result.blocks] == [row, row, row]
    check = remat.verify(model, x, remat.plan(result, strategy="none"), loss_fn, repeats=1)
    assert check.measured_peak_bytes == check.predicted_peak_bytes == result.peak_bytes
    tracker = LiveTracker(torch.device("cpu"))
    tracker.register(model.parameters(), "parameters")
    with tracker:
        loss_fn(model(x), x).backward()
    assert result.peak_bytes == tracker.peak_bytes  # parameters, the step's activations and gradients
