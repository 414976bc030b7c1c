"""The selective policy under torch's two replay protocols.

torch 2.12 and later decide each call of a replay from the forward's answers; torch 2.4 to 2.11
ask the policy again in the replay (``ctx.is_recompute``) and take a cached output for each call
it answers MUST_SAVE, in order. `SavedOpsPolicy` counts the two apart, so the replay's n-th call
gets the forward's n-th answer; counted on from the forward, the replay recomputed every call and
left the whole cache held to the end of the block's backward (an H200 with torch 2.11 measured a
small convolutional net 19 % over its predicted peak). The older protocol is emulated here on
torch's own storage, so both run on this torch."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

import remat
from remat.checkpointing import selective
from remat.checkpointing.selective import SavedOpsPolicy
from remat.plan.planners import make_plan


def test_the_replay_gets_the_forwards_answers_call_by_call():
    mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    policy = SavedOpsPolicy(frozenset({"aten.mm.default#1", "aten.relu.default#0"}))
    calls = [mm, relu, mm, relu, mm]
    forward = [policy(SelectiveCheckpointContext(is_recompute=False), op) for op in calls]
    replay = [policy(SelectiveCheckpointContext(is_recompute=True), op) for op in calls]
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == [again, save, save, again, again]
    assert replay == forward
    assert policy.seen == ["aten.mm.default#0", "aten.relu.default#0", "aten.mm.default#1",
                           "aten.relu.default#1", "aten.mm.default#2"]  # the forward's calls only


def _older_replay(self, func, types, args=(), kwargs=None):
    """torch 2.11's `_CachedTorchDispatchMode.__torch_dispatch__` on this torch's storage: the
    policy decides again; MUST_SAVE takes the overload's next cached output (the list's pop(0))."""
    kwargs = {} if kwargs is None else kwargs
    if func in tuc.SAC_IGNORED_OPS:
        return func(*args, **kwargs)
    policy = self._remat_policy_fn(SelectiveCheckpointContext(is_recompute=True), func, *args, **kwargs)
    if isinstance(policy, bool):
        policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
    if policy not in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
        return func(*args, **kwargs)
    entries = self.storage.get(tuc._sac_storage_key(func, args), {})
    idx = next((i for i in sorted(entries) if entries[i] not in (tuc._RECOMPUTE, tuc._CONSUMED)), None)
    if idx is None:
        raise RuntimeError(f"{func} encountered during backward, but not found in storage")
    entry, entries[idx] = entries[idx], tuc._CONSUMED
    return torch.utils._pytree.tree_map(lambda x: x.get_val(self.allow_cache_entry_mutation), entry)


@pytest.fixture
def older_torch_replay(monkeypatch):
    """The replay mode gets the forward's policy (this torch hands it None), as torch 2.11 did."""
    if not hasattr(tuc, "_sac_storage_key"):
        pytest.skip("this torch replays by the older protocol itself: the 'this torch' case runs it")
    policies = {}
    caching, cached = tuc._CachingTorchDispatchMode, tuc._CachedTorchDispatchMode
    caching_init, cached_init = caching.__init__, cached.__init__

    def remember(self, policy_fn, storage, *args, **kwargs):
        caching_init(self, policy_fn, storage, *args, **kwargs)
        policies[id(storage)] = policy_fn

    def keep_policy(self, policy_fn, storage, *args, **kwargs):
        cached_init(self, policy_fn, storage, *args, **kwargs)
        self._remat_policy_fn = policies[id(storage)]

    monkeypatch.setattr(caching, "__init__", remember)
    monkeypatch.setattr(cached, "__init__", keep_policy)
    monkeypatch.setattr(cached, "__torch_dispatch__", _older_replay)
    # torch 2.11's storage is a list per overload: `_cached_draw` finds no call key there
    monkeypatch.setattr(selective, "_cached_draw", lambda mode, func, args: False)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("protocol", ["this torch", "torch 2.11"])
def test_a_selective_plan_replays_what_it_planned_under_either_protocol(protocol, request):
    if protocol == "torch 2.11":
        request.getfixturevalue("older_torch_replay")
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(16) for _ in range(3)])
    batch = torch.randn(32, 16)
    prof = remat.profile(model, batch, lambda out, b: out.square().mean(), blocks="*", repeats=1)
    # each block caches its first matmul's output (addmm#0) and replays relu and the second
    saved = ("aten.addmm.default#0",)
    plan = make_plan(prof, tuple(remat.Segment(start=i, stop=i + 1, strategy="selective:first-matmul", saved_ops=saved)
                                 for i in range(3)), "selective", None)
    result = remat.verify(model, batch, plan, lambda out, b: out.square().mean(), repeats=1)
    assert result.grads_identical
    assert result.recompute_counts_match, result.op_counts
    assert result.measured_peak_bytes == result.predicted_peak_bytes


class _DropoutThenDropPath(nn.Module):
    """Dropout as one ``native_dropout`` call (its eager form on CUDA), then timm's drop path,
    which draws in place (``new_empty(...).bernoulli_()``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.native_dropout(self.a(x), 0.2, True)[0]
        mask = x.new_empty((x.shape[0], 1)).bernoulli_(0.8)
        return x + self.b(h) * mask / 0.8


@pytest.mark.parametrize("protocol", ["this torch", "torch 2.11"])
def test_a_cached_dropout_advances_the_generator_under_either_protocol(protocol, request):
    """A plan that caches ``native_dropout`` (Megatron's recipe keeps the masks after the
    attention core): the replay takes its output from the cache, and must still draw, or the drop
    path after it takes another mask (gradients off by 0.09 on a real torch 2.11 before the policy
    ran the call in the replay)."""
    if protocol == "torch 2.11":
        request.getfixturevalue("older_torch_replay")
    torch.manual_seed(0)
    model, batch = nn.Sequential(*[_DropoutThenDropPath(16) for _ in range(3)]).train(), torch.randn(8, 16)
    prof = remat.profile(model, batch, lambda out, b: out.square().mean(), blocks="*", repeats=1)
    assert "aten.native_dropout.default#0" in [op.key for op in prof.blocks[1].ops]
    segments = tuple(remat.Segment(start=i, stop=i + 1, strategy="keep") if i != 1 else
                     remat.Segment(start=1, stop=2, strategy="selective:knapsack", saved_ops=("aten.native_dropout.default#0",))
                     for i in range(3))
    plan = make_plan(prof, segments, "layout", None)
    result = remat.verify(model, batch, plan, lambda out, b: out.square().mean(), repeats=1)
    assert result.grads_identical and result.grad_max_abs_diff == 0.0, result.grad_max_abs_diff
    assert result.measured_peak_bytes == result.predicted_peak_bytes
