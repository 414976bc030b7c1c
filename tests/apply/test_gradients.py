"""Every strategy gives bit-identical losses, gradients and buffers on the built-in models (CPU)."""

from __future__ import annotations

import pytest
import torch

from apply_helpers import assert_identical, make_plan, seg, train
from remat._batch import call_model, compute_loss
from remat.apply.opcount import BlockOpCounter
from remat.measure.blocks import find_blocks
from remat.models import MODEL_NAMES, build

MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.convolution.")

TINY_LM = {"num_layers": 3, "d_model": 32, "num_heads": 2, "seq_len": 16, "batch_size": 2, "vocab_size": 64}
MODELS = [
    ("gpt", {**TINY_LM, "attention": "explicit", "num_layers": 4}),
    ("gpt", {**TINY_LM, "attention": "sdpa", "num_layers": 4}),
    ("mlp", {"depth": 4, "width": 32, "batch_size": 4}),
    ("convnet", {"num_blocks": 3, "channels": 4, "image_size": 8, "batch_size": 4}),
    ("hf:gpt2", TINY_LM),
    ("hf:llama", TINY_LM),
]


def _forward_keys(built, blocks) -> list[list[str]]:
    with BlockOpCounter([m for _, m in blocks]) as counter:
        compute_loss(call_model(built.model, built.batch), built.batch, built.loss_fn)
    return counter.forward_keys


def _plans(n: int, keys: list[list[str]], tmp: str) -> dict[str, list]:
    matmuls = [tuple(k for k in keys[i] if k.startswith(MATMULS)) for i in range(n)]
    half = n // 2
    return {
        "full": [seg(i, i + 1) for i in range(n)],
        "every2": [seg(i, min(i + 2, n)) for i in range(0, n, 2)],
        "nested": [seg(0, n, "recompute", seg(0, half), seg(half, n, "selective:x", saved_ops=matmuls[half]))
                   if n - half == 1 else seg(0, n, "recompute", seg(0, half), seg(half + 1, n))],
        "selective-matmuls": [seg(i, i + 1, "selective:save-matmuls", saved_ops=matmuls[i]) for i in range(n)],
        "selective-none": [seg(i, i + 1, "selective:none") for i in range(n)],
        "mixed": [seg(0, 1, "keep"), seg(1, 2, "offload:disk"), seg(2, n, "recompute")],
    }


@pytest.mark.parametrize("name,sizes", MODELS, ids=[f"{n}-{s.get('attention', '')}" for n, s in MODELS])
def test_every_strategy_is_bit_identical(name, sizes, tmp_path):
    if name not in MODEL_NAMES:
        pytest.skip(f"{name} needs transformers")
    torch.manual_seed(0)
    built = build(name, **sizes)
    blocks = find_blocks(built.model)
    names = [n for n, _ in blocks]
    keys = _forward_keys(built, blocks)
    baseline = train(built.model, built.batch, built.loss_fn)
    for label, segments in _plans(len(names), keys, str(tmp_path)).items():
        plan = make_plan(built.model, built.batch, names, segments, label)
        assert_identical(baseline, train(built.model, built.batch, built.loss_fn, plan))


@pytest.mark.parametrize("name,sizes", [MODELS[1], MODELS[3]], ids=["gpt-sdpa", "convnet"])
def test_bit_identical_with_two_threads(name, sizes, tmp_path):
    """The same promise with two intra-op threads, torch's default on this machine (the tests here
    run with one): a replay runs its kernels as the first forward did, on the same shapes, so the
    threads split every reduction the same way."""
    torch.set_num_threads(2)  # the conftest's fixture puts back what it found
    torch.manual_seed(0)
    built = build(name, **sizes)
    blocks = find_blocks(built.model)
    names = [n for n, _ in blocks]
    keys = _forward_keys(built, blocks)  # a forward: BatchNorm's running statistics move before the baseline's copy
    baseline = train(built.model, built.batch, built.loss_fn)
    for label, segments in _plans(len(names), keys, str(tmp_path)).items():
        assert_identical(baseline, train(built.model, built.batch, built.loss_fn,
                                         make_plan(built.model, built.batch, names, segments, label)))
    assert torch.get_num_threads() == 2


def test_dropout_is_active_in_the_tests():
    torch.manual_seed(0)
    built = build("gpt", **TINY_LM)
    first = compute_loss(call_model(built.model, built.batch), built.batch)
    second = compute_loss(call_model(built.model, built.batch), built.batch)
    assert not torch.equal(first, second)


def test_batchnorm_buffers_advance_once_per_step():
    torch.manual_seed(0)
    built = build("convnet", **MODELS[3][1])
    names = [n for n, _ in find_blocks(built.model)]
    plan = make_plan(built.model, built.batch, names, [seg(0, len(names))])
    history = train(built.model, built.batch, built.loss_fn, plan, steps=3)
    assert history[-1]["state"]["blocks.0.bn1.num_batches_tracked"].item() == 3
    baseline = train(built.model, built.batch, built.loss_fn, steps=3)
    assert torch.equal(history[-1]["state"]["blocks.0.bn1.running_mean"], baseline[-1]["state"]["blocks.0.bn1.running_mean"])


def test_staged_convnet_buffers_advance_once_per_step_with_one_guard_per_region():
    """ResNet-like stages (strided units with a projection shortcut, its BatchNorm inside the
    region): every buffer equals the baseline's after 3 steps; each region keeps one buffer guard,
    made on its first call; a step in eval mode (gradients on) moves no statistic, the next
    training step moves them once."""
    from remat import apply_
    from remat.apply.api import RUNTIME_ATTR

    torch.manual_seed(0)
    built = build("convnet", num_blocks=3, channels=4, image_size=8, batch_size=4, downsample_every=2)
    names = [n for n, _ in find_blocks(built.model)]
    plan = make_plan(built.model, built.batch, names, [seg(i, i + 1) for i in range(len(names))])
    history = train(built.model, built.batch, built.loss_fn, plan, steps=3)
    baseline = train(built.model, built.batch, built.loss_fn, steps=3)
    assert_identical(baseline, history)
    for key, value in baseline[-1]["state"].items():
        assert torch.equal(history[-1]["state"][key], value), key
    assert history[-1]["state"]["blocks.2.shortcut.1.num_batches_tracked"].item() == 3

    model = apply_(built.model, plan)
    runtime = model.__dict__[RUNTIME_ATTR]
    compute_loss(call_model(model, built.batch), built.batch, built.loss_fn).backward()
    guards = dict(runtime.guards)
    assert sorted(guards) == [(0, 1), (1, 2), (2, 3)]
    shortcut_bn = model.blocks[2].shortcut[1]
    model.eval()
    before = shortcut_bn.running_mean.clone()
    compute_loss(call_model(model, built.batch), built.batch, built.loss_fn).backward()
    assert torch.equal(shortcut_bn.running_mean, before) and shortcut_bn.num_batches_tracked.item() == 1
    model.train()
    compute_loss(call_model(model, built.batch), built.batch, built.loss_fn).backward()
    assert shortcut_bn.num_batches_tracked.item() == 2
    assert all(runtime.guards[k] is g for k, g in guards.items())


class _CountingBlock(torch.nn.Module):
    """Linear, BatchNorm, ReLU, and a buffer that counts forwards (written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return torch.relu(self.bn(self.lin(x)))


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_CountingBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_replays_update_stand_ins_for_batchnorm_statistics_and_restore_other_buffers():
    """Recompute every block for 3 steps: the forward-counting buffer reads 3 (the replay's
    increment is undone by copy), the BatchNorm statistics equal the baseline's and are the same
    tensor objects as before (the replay updated swapped-in stand-ins, then swapped back), and
    losses and gradients are bit-identical."""
    from remat import apply_
    from remat.apply.api import RUNTIME_ATTR

    torch.manual_seed(0)
    model, batch = _Counting(), torch.randn(8, 6)
    names = [f"blocks.{i}" for i in range(3)]
    plan = make_plan(model, batch, names, [seg(i, i + 1) for i in range(3)])
    history = train(model, batch, lambda out, _: out, plan, steps=3)
    baseline = train(model, batch, lambda out, _: out, steps=3)
    assert_identical(baseline, history)
    for key, value in baseline[-1]["state"].items():
        assert torch.equal(history[-1]["state"][key], value), key
    assert [history[-1]["state"][f"blocks.{i}.calls"].item() for i in range(3)] == [3, 3, 3]

    bn = model.blocks[1].bn
    tensors = (bn.running_mean, bn.running_var, bn.num_batches_tracked)
    apply_(model, plan, batch=batch)
    for _ in range(2):
        model(batch).backward()
    assert (bn.running_mean, bn.running_var, bn.num_batches_tracked) == tensors
    assert bn.num_batches_tracked.item() == 2 and model.blocks[1].calls.item() == 2
    guard = model.__dict__[RUNTIME_ATTR].guards[(1, 2)]
    (swaps, copied, _), = guard._plans.values()
    assert [name for _, name, _, _ in swaps] == ["running_mean", "running_var", "num_batches_tracked"]
    assert [t is model.blocks[1].calls for t in copied] == [True]
    assert swaps[2][3].item() == 1 + 2  # the stand-in: a clone at the first replay (1), one add per replay


class _SpectralBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _Spectral(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SpectralBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("segments", [[seg(i, i + 1) for i in range(3)], [seg(0, 3)]], ids=["per block", "one segment"])
def test_replays_start_from_the_buffers_the_forward_started_from(segments):
    """Spectral norm advances its power-iteration vectors ``_u``/``_v`` in the forward, then
    reads them. Restored only after the replay, they made the replay start from the advanced
    vectors, iterate once more and compute another weight: gradients 4e-3 off, and training
    drifted from the baseline's. The replay now starts from the values the forward started
    from: losses, gradients and every buffer bit-identical over 3 steps."""
    torch.manual_seed(0)
    model, batch = _Spectral(), torch.randn(8, 8)
    names = [f"blocks.{i}" for i in range(3)]
    plan = make_plan(model, batch, names, segments)
    history = train(model, batch, lambda out, _: out, plan, steps=3)
    baseline = train(model, batch, lambda out, _: out, steps=3)
    assert_identical(baseline, history)
    assert any("_u" in key for key in baseline[-1]["state"])
    for key, value in baseline[-1]["state"].items():
        assert torch.equal(history[-1]["state"][key], value), key


class _OldSpectralBlock(torch.nn.Module):
    """``torch.nn.utils.spectral_norm`` (the hook API GAN code uses): a forward pre-hook computes
    the weight from ``weight_orig`` and the advanced ``weight_u`` and keeps it as the Linear's
    plain attribute ``weight``, a tensor with a history."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.utils.spectral_norm(torch.nn.Linear(width, width))
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(x)))


def test_a_weight_a_pre_hook_keeps_as_an_attribute_is_not_held_for_the_replay():
    """A replay puts back the attributes its forward found, and the snapshot of them held the
    weight the last forward had left on ``fc.weight`` (64 KiB here) through the replay: a √N
    segment of two blocks measured two such weights (128 KiB) above its prediction. A tensor with
    a history is a result, not state a replay starts from: the snapshot leaves it, and √N is
    exact. The weight each forward keeps on the module lives to the next step whatever the plan,
    so recomputing a block frees less than its saved bytes: full recomputation measured one
    weight per block (256 KiB) above its prediction, nested segments one per nested block. The
    profile sees it held past the loss (`BlockProfile.saved_code_held_bytes`) and a block not kept
    holds it: exact (left: a nested segment of several such blocks, two weights under)."""
    import remat

    torch.manual_seed(0)
    width = 128
    model = torch.nn.Sequential(torch.nn.Linear(8, width), *[_OldSpectralBlock(width) for _ in range(4)])
    batch = torch.randn(8, 64, 8)
    loss = lambda out, _: out.square().mean()  # noqa: E731
    profile = remat.profile(model, batch, loss, repeats=1)
    above = {}
    for strategy in ("none", "sqrt", "full"):
        check = remat.verify(model, batch, remat.plan(profile, strategy=strategy), loss, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0
        above[strategy] = check.measured_peak_bytes - check.predicted_peak_bytes
    assert above == {"none": 0, "sqrt": 0, "full": 0}
    assert [b.saved_code_held_bytes for b in profile.blocks] == [0] + [width * width * 4] * 4
    from remat.plan.planners import make_plan as layout_plan
    from remat.plan.types import Segment

    def r(a: int, b: int, *children: Segment) -> Segment:
        return Segment(start=a, stop=b, strategy="recompute", children=children)

    for nested in ((r(0, 2), r(2, 5, r(2, 3), r(3, 4))), (Segment(start=0, stop=1, strategy="keep"), r(1, 5, r(2, 3)))):
        check = remat.verify(model, batch, layout_plan(profile, nested, "layout", None), loss, repeats=1)
        assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes, nested
    names = [f"{i}" for i in range(1, 5)]
    for segments in ([seg(i, i + 1) for i in range(4)], [seg(0, 2), seg(2, 4)]):
        history = train(model, batch, loss, make_plan(model, batch, names, segments), steps=3)
        assert_identical(train(model, batch, loss, steps=3), history)
