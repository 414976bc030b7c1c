"""Blocks that are the same computation share their timing probes; every byte stays measured."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat.measure.budget import ProbeBudget
from remat.measure.blocks import find_blocks
from remat.measure.overhead import capture_block_inputs, measure_checkpoint_call_ms, measure_overheads
from remat.measure.profile import profile
from remat.measure.sharing import group_blocks, input_role, stop_after
from remat.measure.types import Profile
from remat.models import build
from remat.plan.planners import pareto, plan
from remat.plan.policies import saved_ops_for
from remat.plan.predict import predict
from remat.plan.types import Segment

WIDTH, ROWS = 8, 4


class _Block(nn.Module):
    """Linear, dropout (functional, ``p`` from a dict the structure does not read), an activation."""

    def __init__(self, *, act: str = "relu", p: float = 0.1, module_p: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(module_p)
        self.opts = {"act": act, "p": p}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(F.dropout(self.linear(x), self.opts["p"], self.training))
        return torch.relu(y) if self.opts["act"] == "relu" else torch.tanh(y)


class _Toy(nn.Module):
    """Seven blocks: 0-2 alike (0 takes the batch, which needs no gradient), 3 another activation
    and 5 another dropout ``p``, both invisible to the structure; 4 another ``nn.Dropout`` ``p``
    and 6 twice the rows, both visible."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(), _Block(), _Block(act="tanh"), _Block(module_p=0.5),
                                     _Block(p=0.3), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:6]:
            x = block(x)
        return self.blocks[6](torch.cat([x, x]))[: x.shape[0]].square().mean()


@pytest.fixture(scope="module")
def toy_profiles() -> dict[bool, Profile]:
    torch.manual_seed(0)
    model, batch = _Toy(), torch.randn(ROWS, WIDTH)
    return {share: profile(model, batch, repeats=2, share_timing=share) for share in (True, False)}


def test_which_blocks_share_on_a_toy(toy_profiles):
    shared = toy_profiles[True]
    assert [b.timing_from for b in shared.blocks] == [0, 1, 1, 3, 4, 5, 6]
    # 3 and 5 are alike in structure to block 1 (a dict is not read) but their traced forwards
    # differ: tanh for relu, and native_dropout called with p 0.3: the check measures them apart
    assert shared.timing_split == (3, 5)
    alone = toy_profiles[False]
    assert [b.timing_from for b in alone.blocks] == list(range(7)) and alone.timing_split == ()


def test_members_take_their_representatives_timing_probes(toy_profiles):
    blocks = toy_profiles[True].blocks
    for name in ("recompute_overhead_ms", "selective_overhead_ms", "selective_cache_overhead_ms"):
        assert getattr(blocks[2], name) == getattr(blocks[1], name)
    # op times: the representative's shares, scaled to the member's own forward time in the step
    shares = [[op.time_ms / sum(o.time_ms for o in b.ops) for op in b.ops] for b in (blocks[1], blocks[2])]
    assert shares[0] == pytest.approx(shares[1], rel=1e-9)
    assert sum(op.time_ms for op in blocks[2].ops) == pytest.approx(blocks[2].fwd_ms, rel=1e-9)


def _without_timing(value: Any) -> Any:
    """Every float (times, rates) 0, what says where timing came from and fault counts left out:
    what remains is bytes, FLOPs, op tables and names."""
    if isinstance(value, float):
        return 0.0
    if isinstance(value, tuple):
        return tuple(_without_timing(v) for v in value)
    if isinstance(value, dict):
        return {k: _without_timing(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _without_timing(getattr(value, f.name)) for f in dataclasses.fields(value)}
        neutral = {"timing_from": None, "timing_split": (), "step_fault_bytes": 0}
        fields.update((name, empty) for name, empty in neutral.items() if name in fields)
        return dataclasses.replace(value, **fields)
    return value


@pytest.mark.parametrize("name, sizes", [
    ("gpt", dict(num_layers=3, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)),
    ("mlp", dict(depth=4, width=16, batch_size=4)),
    # each layer keeps its own index (layer_idx) and the first saves the rotary tables for all
    pytest.param("hf:llama", dict(num_layers=3, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64),
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                          reason="transformers is not installed")),
])
def test_a_shared_profile_predicts_the_bytes_of_a_fully_measured_one(name, sizes):
    built = build(name, **sizes)
    shared, alone = (profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, share_timing=s)
                     for s in (True, False))
    assert [b.timing_from for b in shared.blocks] == ([0, 1, 1, 1] if name == "mlp" else [0, 0, 0])
    assert _without_timing(shared) == _without_timing(alone)  # every byte, FLOP and op, exactly
    n = shared.num_blocks
    seg = lambda start, stop, strategy: Segment(start=start, stop=stop, strategy=strategy)  # noqa: E731
    selective = [Segment(start=i, stop=i + 1, strategy="selective:save-matmuls",
                         saved_ops=saved_ops_for("save-matmuls", shared.blocks[i])) for i in range(2, n)]
    layouts = [[seg(0, n, "keep")], [seg(0, n, "recompute")],
               [seg(i, i + 1, "recompute" if i % 2 else "keep") for i in range(n)], [seg(0, 2, "recompute"), *selective]]
    for layout in layouts:
        assert predict(shared, layout).peak_bytes == predict(alone, layout).peak_bytes
    # plans, where the times are the same: the shared profile's times on the fully measured one
    timed = _with_times_of(alone, shared)
    for budget in (None, pareto(shared)[-1].prediction.peak_bytes):
        assert plan(shared, budget).segments == plan(timed, budget).segments
    assert [p.prediction.peak_bytes for p in pareto(shared)] == [p.prediction.peak_bytes for p in pareto(timed)]


def _with_times_of(target: Profile, source: Profile) -> Profile:
    """``target`` with every timing figure of ``source`` (same model, same blocks)."""
    times = ("fwd_ms", "bwd_ms", "selective_overhead_ms", "selective_cache_overhead_ms", "recompute_overhead_ms")
    blocks = tuple(dataclasses.replace(
        b, ops=tuple(dataclasses.replace(op, time_ms=s_op.time_ms) for op, s_op in zip(b.ops, s.ops)),
        **{name: getattr(s, name) for name in times}) for b, s in zip(target.blocks, source.blocks))
    profile_times = ("fixed_fwd_ms", "fixed_bwd_ms", "step_ms", "optimizer_step_ms", "first_touch_ms_per_byte",
                     "checkpoint_call_ms", "step_fault_bytes", "head")
    return dataclasses.replace(target, blocks=blocks, **{name: getattr(source, name) for name in profile_times})


def test_group_blocks_by_hand():
    groups = group_blocks(["a", "a", "a", "b", "a"], [1, 1, 2, 1, 2])
    assert groups.timing_from == (0, 0, 2, 3, 2) and groups.split == (2,)
    assert groups.representatives == (0, 2, 3) and groups.members(2) == (2, 4)
    assert group_blocks(["a", "a"], [1, 1], share=False).timing_from == (0, 1)
    with pytest.raises(ValueError, match=r"2 structure keys for 1 trace keys"):
        group_blocks(["a", "a"], [1])


def test_input_roles():
    assert [input_role(s, 5) for s in ("previous", "between", "outside", "shared", "block:3")] == [
        "chain", "chain", "chain", "shared", "skip:-2"]


def test_stop_after_runs_the_forward_up_to_a_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append("last"))
    with stop_after(model[1]):
        model(torch.ones(1, 2))
    assert seen == [] and not model[1]._forward_hooks  # stopped, and the hook is gone
    with stop_after(None):
        model(torch.ones(1, 2))
    assert seen == ["last"]


@pytest.mark.parametrize("step_ms, steps, run_ms, expected", [
    (10.0, 2.0, 4.0, 5),  # 20 ms of budget, 4 ms a run
    (100.0, 2.0, 4.0, 50),  # a ten times slower step: ten times the runs
    (1.0, 2.0, 4.0, 3),  # under the least: the least
    (1e6, 2.0, 4.0, 400),  # over the most: the most
    (10.0, 2.0, 0.0, 400),  # a run too fast to time: the most
])
def test_probe_repeats_scale_with_the_step(step_ms, steps, run_ms, expected):
    assert ProbeBudget(step_ms=step_ms, steps=steps, min_repeats=3).repeats(run_ms) == expected


def test_a_fast_step_gets_the_floor():
    budget = ProbeBudget(step_ms=1.0, steps=2.0, min_repeats=3, floor_ms=40.0)
    assert budget.repeats(4.0) == 10  # 40 ms, not 2 ms: 10 runs of 4 ms
    assert dataclasses.replace(budget, step_ms=100.0).repeats(4.0) == 50  # 200 ms of steps: over the floor
    assert budget.split(4).repeats(4.0) == 3  # a quarter each: 10 ms, under the least


def test_probe_budget_errors():
    with pytest.raises(ValueError, match=r"step_ms=-1.0, steps=2.0 and floor_ms=0.0 must be >= 0"):
        ProbeBudget(step_ms=-1.0, steps=2.0)
    with pytest.raises(ValueError, match=r"min_repeats=5, max_repeats=4: need 1 <= min_repeats <= max_repeats"):
        ProbeBudget(step_ms=1.0, steps=1.0, min_repeats=5, max_repeats=4)
    assert ProbeBudget(step_ms=10.0, steps=3.0).split(2).budget_ms == 15.0


class _FakeClock:
    """Every span lasts ``ms``; nothing to synchronise."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def mark(self) -> float:
        return 0.0

    def elapsed_ms(self, start: float, end: float) -> float:
        return self.ms

    def sync(self) -> None:
        pass


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.relu(self.linear(x))


@pytest.mark.parametrize("step_ms, timed", [(10.0, 5), (40.0, 20), (1.0, 2)])
def test_overhead_probe_repeats_follow_the_step_time(step_ms, timed):
    # each run reads 1 ms on the injected clock; a repeat runs the block 4 ways (plain, checkpointed,
    # selective, cached): 4 ms. Budget 2 steps: 20 ms at a 10 ms step, 5 timed repeats.
    model = nn.Sequential(_Counted())
    block_list = find_blocks(model, "0")
    inputs = capture_block_inputs(block_list, lambda: model(torch.randn(ROWS, WIDTH, requires_grad=True)))
    model[0].calls = 0
    budget = ProbeBudget(step_ms=step_ms, steps=2.0, min_repeats=2)
    measure_overheads(block_list, inputs, [frozenset()], repeats=2, clock=_FakeClock(1.0), budget=budget)
    # forward calls: 1 for the checkpointed forward's curve, then per repeat (the warm-up and the
    # timed ones) 1 plain + 2 checkpointed (forward, replay) + 2 selective + 2 cached
    assert model[0].calls == 1 + 7 * (1 + timed)


@pytest.mark.parametrize("step_ms, pairs", [(10.0, 25), (100.0, 50), (1e5, 400)])
def test_checkpoint_call_probe_pairs_follow_the_step_time(step_ms, pairs, monkeypatch):
    calls = []
    import remat.measure.overhead as overhead

    real = overhead._timed_run
    monkeypatch.setattr(overhead, "_timed_run", lambda *a, **k: calls.append(1) or real(*a, **k))
    budget = ProbeBudget(step_ms=step_ms, steps=1.0)
    measure_checkpoint_call_ms(torch.device("cpu"), repeats=1, clock=_FakeClock(1.0), budget=budget)
    # a pair reads 2 ms: 1 step of 100 ms fits 50 pairs; never fewer than 25 (10 x repeats, 25), nor over 400
    assert len(calls) == 2 * (1 + pairs)
