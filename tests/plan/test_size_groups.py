"""Calls whose output sizes follow the data: a mixture of experts routes each token to one expert,
and each expert's calls run on the tokens routed to it. The profile sees one batch; a selective
plan that caches expert 0's matmul holds expert 0's tokens of whatever batch comes. The profile
finds these calls by comparing two layers of one structure (each routes its own way), groups
them by family (one projection over every expert), and the planner caches a family whole or not
at all: its total is the same every batch. Before, 214 of 230 selective options of the first
layer held other bytes after the forward on another batch than on the profiled one (a JetMoE
layer caching one expert's matmul measured 64 to 512 bytes above its prediction)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
import remat.measure.profile as profile_module
from remat.measure.size_groups import FIXED, UNCACHED, family_key, shape_from_values, size_groups
from remat.measure.tracker import LiveTracker
from remat.measure.types import OpRecord
from remat.plan.planners import make_plan
from remat.plan.policies import attention_core, knapsack_frontier, op_cacheable, save_matmuls
from remat.plan.search import block_options
from remat.plan.types import Segment
from test_cached_inputs import _square

T, D, H, E = 64, 16, 32, 4


class MoE(nn.Module):
    """Top-1 routing over ``E`` experts, each a two-layer MLP on the tokens routed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, D) / D**0.5)
        self.w2 = nn.Parameter(torch.randn(E, D, H) / H**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, route = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            idx = torch.where(route == e)[0]
            h = torch.relu(F.linear(x[idx], self.w1[e]))
            out.index_add_(0, idx, F.linear(h, self.w2[e]) * gate[idx, None])
        return x + out


class Net(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoE() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model, batch, other = Net(2), torch.randn(T, D), torch.randn(T, D)
    return model, batch, other, remat.profile(model, batch, _square, repeats=1)


def _tokens(model: Net, batch: torch.Tensor, layer: int) -> list[int]:
    """Tokens per expert of ``layer`` on ``batch``."""
    with torch.no_grad():
        x = batch
        for moe in model.layers[:layer]:
            x = moe(x)
        route = model.layers[layer].router(x).argmax(dim=-1)
    return [int((route == e).sum()) for e in range(E)]


def _live_after_forward(model: Net, plan, batch: torch.Tensor) -> int:
    """Bytes live once the forward and the loss have run: parameters, what autograd saves, the
    selective caches, the output and the loss."""
    remat.apply_(model, plan)
    try:
        tracker = LiveTracker(torch.device("cpu"))
        tracker.register(model.parameters(), "parameters")
        with tracker:
            loss = _square(model(batch), batch)
            live = tracker.live_bytes
        del loss
    finally:
        remat.remove_(model)
    return live


def _layout(prof, option: Segment) -> tuple[Segment, ...]:
    return (option, *(Segment(start=i, stop=i + 1, strategy="keep") for i in range(1, prof.num_blocks)))


def test_the_batches_route_differently(case):
    model, batch, other, _ = case
    assert _tokens(model, batch, 0) != _tokens(model, other, 0)
    assert _tokens(model, batch, 0) != _tokens(model, batch, 1)


def test_every_expert_call_is_in_its_family(case):
    model, batch, _, prof = case
    first = prof.blocks[0]
    grouped = [op for op in first.ops if op.size_group >= 0]
    # per expert: where's nonzero and unbind, x[idx], the two matmuls, relu, gate[idx], the product,
    # index_add_ (in place: no bytes): 9 calls each, one family per call of the expert's body
    assert len(grouped) == 9 * E
    families = {op.size_group: [o.key for o in grouped if o.size_group == op.size_group] for op in grouped}
    assert len(families) == 9 and all(len(keys) == E for keys in families.values())
    by_key = {op.key: op for op in first.ops}
    first_mm = [by_key[f"aten.mm.default#{1 + 2 * e}"] for e in range(E)]
    assert len({op.size_group for op in first_mm}) == 1
    # their bytes follow expert 0..3's tokens; the family's total is every token's
    tokens = _tokens(model, batch, 0)
    assert [op.output_bytes for op in first_mm] == [n * H * 4 for n in tokens]
    assert sum(op.output_bytes for op in first_mm) == T * H * 4
    # the router's matmul and softmax run on every token: fixed
    assert by_key["aten.mm.default#0"].size_group == FIXED
    assert by_key["aten._softmax.default#0"].size_group == FIXED


def test_knapsack_caches_a_family_whole_or_not_at_all(case):
    _, _, _, prof = case
    first = prof.blocks[0]
    families: dict[int, set[str]] = {}
    for op in first.ops:
        if op.size_group >= 0 and not op.is_view and op_cacheable(op):
            families.setdefault(op.size_group, set()).add(op.key)
    frontier = knapsack_frontier(first)
    assert len(frontier) > 10
    for _, _, keys in frontier:
        for members in families.values():
            assert members <= set(keys) or not members & set(keys), (members, keys)
    # both family-respecting fixed policies: save-matmuls saves every expert matmul; the router's
    # softmax puts the first expert's matmul in the attention core, which replays that family whole
    matmuls = {op.key for op in first.ops if op.name == "aten.mm.default"}
    assert set(save_matmuls(first)) == matmuls
    core = set(attention_core(first))
    assert not core & {f"aten.mm.default#{1 + 2 * e}" for e in range(E)}
    assert {f"aten.mm.default#{2 + 2 * e}" for e in range(E)} <= core


def test_every_selective_option_holds_the_same_bytes_on_another_batch(case):
    model, batch, other, prof = case
    options = [o for o in block_options(prof, 0) if o.kind == "selective"]
    assert len(options) > 10
    for option in options:
        plan = make_plan(prof, _layout(prof, option), "layout", None)
        assert _live_after_forward(model, plan, batch) == _live_after_forward(model, plan, other), option.saved_ops


def test_selective_options_measure_as_predicted(case):
    model, batch, _, prof = case
    options = [o for o in block_options(prof, 0) if o.kind == "selective"]
    for option in options[:: max(1, len(options) // 8)]:
        plan = make_plan(prof, _layout(prof, option), "layout", None)
        check = remat.verify(model, batch, plan, _square, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0
        assert check.measured_peak_bytes == check.predicted_peak_bytes, option.saved_ops


def test_one_layer_alone_is_compared_with_another_draw(case):
    # no other layer of its structure: its forward runs once more on its input plus noise, which
    # routes the tokens anew, and the families are the same as two layers show
    torch.manual_seed(0)
    model = Net(1)
    prof = remat.profile(model, torch.randn(T, D), _square, blocks="layers.*", repeats=1)
    assert [op.size_group for op in prof.blocks[0].ops] == [op.size_group for op in case[3].blocks[0].ops]
    assert sum(op.size_group >= 0 for op in prof.blocks[0].ops) == 9 * E


class HitMoE(MoE):
    """`MoE` looping over the experts the batch hits (Mixtral's eager kernel): as many passes as
    experts hit, so the calls after the loop's start have other keys on another batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, route = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        out = torch.zeros_like(x)
        hit = torch.bincount(route, minlength=E).gt(0).nonzero()
        for e in hit:  # unbind along the first dimension: one pass per expert hit
            idx = torch.where(route == e)[0]
            h = torch.relu(F.linear(x[idx], self.w1[e.item()]))
            out.index_add_(0, idx, F.linear(h, self.w2[e.item()]) * gate[idx, None])
        return torch.tanh(x + out)


def test_a_loop_over_the_experts_hit_is_never_cached():
    torch.manual_seed(0)
    model = Net(2)
    for i in range(2):
        model.layers[i].__class__ = HitMoE
    generator = torch.Generator().manual_seed(0)  # 6 tokens, four experts: two hit, then four
    batch, other = torch.randn(6, D, generator=generator), torch.randn(6, D, generator=generator)
    hits = [len(set(model.layers[0].router(x).argmax(dim=-1).tolist())) for x in (batch, other)]
    assert hits == [2, 4]
    prof = remat.profile(model, batch, _square, repeats=1)
    ops = prof.blocks[0].ops
    # the router runs on every token; from bincount (whose length follows the values) on, every call
    # is never cached: the layers ran other calls (two experts hit, then three), and the loop
    # iterates the nonzero's output, whose length follows the values
    start = next(j for j, op in enumerate(ops) if op.name == "aten.bincount.default")
    assert [op.key for op in ops[:start] if not op.is_view] == [
        "aten.mm.default#0", "aten._softmax.default#0", "aten.max.dim#0", "aten.zeros_like.default#0"]
    assert all(op.size_group == FIXED for op in ops[:start])
    assert all(op.size_group == UNCACHED for op in ops[start:])
    options = [o for o in block_options(prof, 0) if o.kind == "selective"]
    assert options and not any(set(o.saved_ops) & {op.key for op in ops[start:]} for o in options)
    for option in options:
        plan = make_plan(prof, _layout(prof, option), "layout", None)
        assert _live_after_forward(model, plan, batch) == _live_after_forward(model, plan, other), option.saved_ops


def _op(key: str, nbytes: int) -> OpRecord:
    return OpRecord(key=key, name=key.split("#")[0], output_bytes=nbytes, saved_bytes=0, time_ms=0.0, flops=0,
                    is_random=False, is_view=False, storage_ids=(0,), storage_bytes=(nbytes,), storage_escapes=(False,))


def _mm(rows: int) -> tuple:
    return (("tuple", ((rows, 8), torch.float32, True, "cpu"), ((8, 4), torch.float32, True, "cpu")), ("dict",))


def test_size_groups_by_hand():
    # two blocks alike, three calls each: a fixed matmul on 10 rows, then two experts' matmuls
    keys = ["aten.mm.default#0", "aten.mm.default#1", "aten.mm.default#2"]
    ops = [tuple(_op(k, rows * 16) for k, rows in zip(keys, (10, 3, 7))),
           tuple(_op(k, rows * 16) for k, rows in zip(keys, (10, 6, 4)))]
    args = [[_mm(10), _mm(3), _mm(7)], [_mm(10), _mm(6), _mm(4)]]
    # the fixed matmul shares the experts' family (same widths): it joins it, the total is still fixed
    assert size_groups((0, 0), ops, args) == [(0, 0, 0), (0, 0, 0)]
    # blocks of other structures are not compared
    assert size_groups((0, 1), ops, args) == [(FIXED,) * 3, (FIXED,) * 3]
    # a family whose total follows the data too (a router that drops tokens) is never cached
    dropped = [ops[0], tuple(_op(k, rows * 16) for k, rows in zip(keys, (10, 6, 2)))]
    assert size_groups((0, 0), dropped, [args[0], [_mm(10), _mm(6), _mm(2)]]) == [(UNCACHED,) * 3] * 2
    # an op whose other dimensions change is not a family's member: never cached
    wide = (("tuple", ((3, 8), torch.float32, True, "cpu"), ((8, 5), torch.float32, True, "cpu")), ("dict",))
    got = size_groups((0, 0), ops, [args[0], [_mm(10), wide, _mm(7)]])
    assert got[1][1] == UNCACHED
    # a gather by a boolean mask makes as many rows as the mask holds: never cached, even where the
    # blocks agree (by chance); by an integer index, the index's shape: fixed
    by_mask = (("tuple", ((10, 8), torch.float32, True, "cpu"), ("list", ((10,), torch.bool, False, "cpu"))), ("dict",))
    by_ids = (("tuple", ((10, 8), torch.float32, True, "cpu"), ("list", ((4,), torch.int64, False, "cpu"))), ("dict",))
    gathers = [(_op("aten.index.Tensor#0", 96), _op("aten.index.Tensor#1", 128))] * 2
    assert size_groups((0, 0), gathers, [[by_mask, by_ids]] * 2) == [(UNCACHED, FIXED)] * 2
    assert shape_from_values("aten.nonzero.default", (("tuple", ((10,), torch.bool, False, "cpu")), ("dict",)))
    assert not shape_from_values("aten.mm.default", _mm(3))
    # a roll by a delay each layer's data picks (Autoformer's): other numbers, the same sizes
    def roll(shift: int) -> tuple:
        return (("tuple", ((10, 8), torch.float32, True, "cpu"), ("list", shift), ("list", 1)), ("dict",))

    rolls = [(_op("aten.roll.default#0", 320),)] * 2
    assert size_groups((0, 0), rolls, [[roll(-3)], [roll(-5)]]) == [(FIXED,)] * 2
    # the first block's input needs no gradient: the flags do not split the family
    assert family_key("aten.mm.default", _mm(3)) == family_key("aten.mm.default", _mm(9))


def test_a_lone_layer_looping_over_the_experts_hit(monkeypatch):
    # no other layer to compare with, nor another draw: the loop itself (unbind along the first
    # dimension of the nonzero's output) marks every call from the nonzero on
    monkeypatch.setattr(profile_module, "DRAWS", 0)
    torch.manual_seed(0)
    model = Net(1)
    model.layers[0].__class__ = HitMoE
    prof = remat.profile(model, torch.randn(T, D), _square, blocks="layers.*", repeats=1)
    ops = prof.blocks[0].ops
    start = next(j for j, op in enumerate(ops) if op.name == "aten.nonzero.default")
    assert all(op.size_group == UNCACHED for op in ops[start:])
    assert sum(op.size_group == UNCACHED for op in ops[:start]) == 1  # bincount, whose length follows values


def test_remat_profile_says_so(case):
    from remat.cli.profile import size_group_summary, state_summary

    line = size_group_summary(case[3])
    # per layer: nine families of four calls each, the four unbinds views among them
    assert line == ("calls whose sizes follow the data (a router's tokens per expert) in 2 block(s): 64 in 18 "
                    "families that selective plans cache whole or not at all, 0 never cached (their sizes, or "
                    "which call a plan's name meets, change with the batch)")
    assert line in state_summary(case[3])
