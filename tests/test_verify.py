"""verify: identical gradients, exact op counts, measured peak against predicted, and the
user's model and optimizer untouched."""

from __future__ import annotations

import copy
import dataclasses
import gc
import functools
import importlib

import pytest
import torch
from torch import nn

import remat
from remat.models import build
from remat.plan.planners import plan as make_plan
from remat.verify_types import Verification

TINY = {
    "gpt": {"num_layers": 3, "d_model": 32, "num_heads": 2, "seq_len": 16, "batch_size": 2, "vocab_size": 64},
    "mlp": {"depth": 4, "width": 32, "batch_size": 4},
    "convnet": {"num_blocks": 3, "channels": 4, "image_size": 8, "batch_size": 4},
}
PEAK_TOLERANCE_PCT = 2.0
"""Measured peak (live-storage tracker) against the planner's prediction, built-in models."""


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _profiled(name: str):
    torch.manual_seed(0)
    built = build(name, **TINY[name])
    return built, remat.profile(built.model, built.batch, built.loss_fn, built.optimizer)


def _verify(name: str, strategy: str, **options) -> Verification:
    built, prof = _profiled(name)
    return remat.verify(built.model, built.batch, make_plan(prof, strategy=strategy), built.loss_fn,
                        built.optimizer, repeats=1, **options)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("strategy", ["none", "full", "sqrt"])
def test_peak_within_tolerance_and_gradients_identical(name, strategy):
    v = _verify(name, strategy)
    assert v.grads_identical and v.ok and v.tolerance == 0.0
    assert v.loss_max_abs_diff == v.output_max_abs_diff == v.grad_max_abs_diff == 0.0
    assert v.recompute_counts_match
    assert abs(v.peak_error_pct) <= PEAK_TOLERANCE_PCT, (v.measured_peak_bytes, v.predicted_peak_bytes)


def test_full_recomputation_replays_every_forward_op_once():
    v = _verify("gpt", "full")
    rows = {(c.block, c.op): c for c in v.op_counts}
    addmm = rows[("blocks.1", "aten.addmm.default")]
    # 4 linears per block (qkv, proj, fc, proj); their backward uses mm, so addmm runs only in forwards
    assert (addmm.baseline_count, addmm.planned_count, addmm.expected_count) == (4, 8, 8)
    softmax = rows[("blocks.0", "aten._softmax.default")]
    assert (softmax.baseline_count, softmax.planned_count) == (1, 2)
    backward = rows[("blocks.2", "aten._softmax_backward_data.default")]
    assert backward.baseline_count == backward.planned_count == 1


def test_selective_policies_are_identical_and_counted():
    for strategy in ("selective:attention-core", "selective:save-matmuls"):
        v = _verify("gpt", strategy)
        assert v.grads_identical and v.recompute_counts_match
    rows = {(c.block, c.op): c for c in _verify("gpt", "selective:save-matmuls").op_counts}
    assert rows[("blocks.0", "aten.addmm.default")].planned_count == 4  # saved: not replayed
    assert rows[("blocks.0", "aten._softmax.default")].planned_count == 2  # replayed


SELECTIVE_OVER_PCT = 5.0
"""How far above the measurement a selective plan's predicted peak may be: cached outputs that
autograd does not save are counted as held through the block's replay, an upper bound (the
replay frees each once it fetches it)."""


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("strategy", ["selective:attention-core", "selective:save-matmuls"])
def test_selective_peaks_are_predicted_from_the_measured_free_order(name, strategy):
    v = _verify(name, strategy)
    assert v.grads_identical
    assert -SELECTIVE_OVER_PCT <= v.peak_error_pct <= PEAK_TOLERANCE_PCT, (v.measured_peak_bytes, v.predicted_peak_bytes)


def test_verify_leaves_the_model_and_optimizer_as_they_were():
    torch.manual_seed(0)
    built = build("gpt", **TINY["gpt"])
    built.optimizer.zero_grad()
    from remat._batch import call_model, compute_loss

    compute_loss(call_model(built.model, built.batch), built.batch).backward()
    built.optimizer.step()
    weights = copy.deepcopy(built.model.state_dict())
    opt_state = copy.deepcopy(built.optimizer.state_dict())
    rng = torch.get_rng_state()
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer)
    remat.verify(built.model, built.batch, make_plan(prof, strategy="full"), built.loss_fn, built.optimizer, repeats=1)
    assert all(torch.equal(weights[k], v) for k, v in built.model.state_dict().items())
    after = built.optimizer.state_dict()
    for index, state in opt_state["state"].items():
        assert all(torch.equal(state[k], after["state"][index][k]) for k in state)
    assert not remat.apply.api.is_applied(built.model)
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("strategy", ["full", "selective:save-matmuls"])
def test_verify_frees_its_copies_of_the_model_without_waiting_for_the_collector(strategy):
    """The baseline and planned copies go when `verify` returns: the step tracker's and the op
    counter's hooks were bound methods of objects holding the copy's blocks, reference cycles
    that kept every copy (weights, gradients, optimizer state) until the cyclic collector ran,
    however many plans a run verified."""
    built, prof = _profiled("gpt")
    cls = type(built.model)
    plan = make_plan(prof, strategy=strategy)
    gc.collect()
    gc.disable()
    try:
        before = sum(isinstance(o, cls) for o in gc.get_objects())
        remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=1)
        assert sum(isinstance(o, cls) for o in gc.get_objects()) == before  # the two copies are gone
    finally:
        gc.enable()


def test_plans_for_gradient_accumulation_fit_a_micro_batch_whose_gradients_add_to_the_last():
    """Planned from a single step, a step of two micro-batches peaked 6-19 % over the plan's
    prediction: every gradient is live through the second. ``grad_accumulation=True`` plans for
    that step, and `verify` measures it (a micro-batch after one whose gradients it adds to);
    the peak measured by tracking two micro-batches and the optimizer step by hand is the same."""
    from remat._batch import call_model, compute_loss
    from remat.measure.tracker import track_step

    torch.manual_seed(0)
    built = build("gpt", **TINY["gpt"], dropout=0.0)
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, grad_accumulation=True)
    assert prof.grad_accumulation and prof.grad_bytes == 0 and prof.accumulated_grad_bytes > 0
    assert all(b.grad_bytes == b.between_grad_bytes == 0 for b in prof.blocks)
    single = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer)
    assert prof.accumulated_grad_bytes == single.grad_bytes and prof.model_state_bytes == single.model_state_bytes
    for plan in remat.pareto(prof):
        assert plan.grad_accumulation
        check = remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=1)
        assert check.ok and check.grads_identical
        assert check.measured_peak_bytes <= plan.prediction.peak_bytes <= 1.01 * check.measured_peak_bytes
        model = copy.deepcopy(built.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.load_state_dict(built.optimizer.state_dict())
        remat.apply_(model, plan)

        def two_micro_batches():
            optimizer.zero_grad(set_to_none=True)
            for _ in range(2):
                (compute_loss(call_model(model, built.batch), built.batch, built.loss_fn) / 2).backward()
            optimizer.step()

        two_micro_batches()
        measured = track_step(two_micro_batches, model=model, optimizer=optimizer, blocks=plan.block_names,
                              batch=built.batch).peak_bytes
        assert measured == check.measured_peak_bytes, plan.block_strategies()
    one_step = remat.pareto(single)[0]
    assert one_step.prediction.peak_bytes < remat.pareto(prof)[0].prediction.peak_bytes


def test_a_replay_with_other_dropout_masks_is_caught(monkeypatch):
    import remat.checkpointing.region as region

    real = region.checkpoint
    monkeypatch.setattr(region, "checkpoint", lambda *a, **k: real(*a, **{**k, "preserve_rng_state": False}))
    v = _verify("gpt", "full")
    assert not v.grads_identical and not v.ok
    assert v.grad_max_abs_diff > 0.0 and v.loss_max_abs_diff == 0.0


def test_verification_json_round_trip(tmp_path):
    v = _verify("convnet", "sqrt")
    assert Verification.from_json(v.to_json()) == v
    v.save(tmp_path / "v.json")
    assert Verification.load(tmp_path / "v.json") == v


def test_bad_arguments():
    built, prof = _profiled("mlp")
    plan = make_plan(prof, strategy="full")
    with pytest.raises(TypeError, match="needs a remat Plan"):
        remat.verify(built.model, built.batch, plan.to_json())
    with pytest.raises(ValueError, match=r"repeats=0 must be an integer >= 1"):
        remat.verify(built.model, built.batch, plan, built.loss_fn, repeats=0)
    other, _ = _profiled("gpt")
    with pytest.raises(ValueError, match="the plan does not match this model"):
        remat.verify(other.model, other.batch, plan)


def test_step_times_are_paired_and_compared_at_this_runs_speed(monkeypatch):
    """Timing: one untimed step each, then rounds in swapped order (base, plan), (plan, base)...;
    the side-by-side error scales the prediction by the baseline measured beside it."""
    verify_module = importlib.import_module("remat.verify")  # `remat.verify` is the function

    clock_ms = iter([100.0, 150.0,  # untimed warm-up: base, plan
                     110.0, 180.0,  # round 0: base then plan
                     170.0, 90.0,   # round 1: plan then base
                     120.0, 175.0])  # round 2: base then plan
    monkeypatch.setattr(verify_module._Run, "timed_step", lambda self, clock: next(clock_ms))
    built, prof = _profiled("mlp")
    plan = make_plan(prof, strategy="full")
    v = remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=3)
    pred = plan.prediction
    assert (v.baseline_step_ms, v.measured_step_ms) == (110.0, 175.0)  # medians of [110, 90, 120], [180, 170, 175]
    assert v.predicted_baseline_step_ms == pytest.approx(pred.step_ms - pred.extra_ms)
    assert v.predicted_overhead_pct == pytest.approx(100 * pred.extra_ms / (pred.step_ms - pred.extra_ms))
    assert v.paired_step_error_pct == pytest.approx(100 * (175.0 / (110.0 * (1 + v.predicted_overhead_pct / 100)) - 1))
    assert v.baseline_drift_pct == pytest.approx(100 * (110.0 / v.predicted_baseline_step_ms - 1))
    assert v.step_error_pct == pytest.approx(100 * (175.0 / pred.step_ms - 1))


class _HostMaskedChain(torch.nn.Module):
    """Masks input features with NumPy's global generator before its blocks (as wav2vec2 and
    HuBERT draw SpecAugment masks) and scales between blocks by a draw of Python's `random`."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        x = x * torch.from_numpy(np.random.rand(*x.shape) < 0.5).to(x.dtype)
        for block in self.blocks:
            x = block(x) * (1.0 + random.random())
        return x


def test_host_random_draws_are_the_same_in_both_runs_and_the_callers_state_is_kept():
    """Without seeding NumPy and `random`, the baseline and the planned run mask different
    features and the gradients differ with no recomputation at all."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = _HostMaskedChain()
    batch = torch.randn(4, 8)
    loss_fn = lambda out, _: out.square().sum()  # noqa: E731
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    np.random.seed(7)
    random.seed(7)
    numpy_before, python_before = np.random.get_state(), random.getstate()
    for strategy in ("none", "full"):
        check = remat.verify(model, batch, make_plan(prof, strategy=strategy), loss_fn, repeats=1)
        assert check.ok and check.grads_identical and check.grad_max_abs_diff == 0.0, strategy
    after = np.random.get_state()
    assert after[0] == numpy_before[0] and np.array_equal(after[1], numpy_before[1]) and after[2:] == numpy_before[2:]
    assert random.getstate() == python_before


class _Reseeding(torch.nn.Module):
    """Reseeds torch's generator from the OS in its forward (as Reformer's layers call
    ``torch.seed()``), then drops out: two runs from the same seed differ without any plan."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.seed()
        x = torch.nn.functional.dropout(x, 0.5, training=self.training)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_a_model_that_differs_from_itself_is_said_to():
    torch.manual_seed(0)
    model = _Reseeding()
    batch = torch.randn(4, 8)
    loss_fn = lambda out, _: out.square().sum()  # noqa: E731
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    check = remat.verify(model, batch, make_plan(prof, strategy="none"), loss_fn, repeats=1)
    assert not check.ok and not check.grads_identical
    assert "the model without a plan is not deterministic: two of its runs from the same weights and seed differ" \
        in check.tolerance_reason


class _SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8, sparse=True)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        return h.square().mean()


def test_a_sparse_gradient_is_compared_densely():
    """``nn.Embedding(sparse=True)`` (trained with SGD or SparseAdam) gives a sparse gradient,
    on which verify's comparison raised NotImplementedError."""
    torch.manual_seed(0)
    model, idx = _SparseEmbedding(), torch.randint(0, 16, (4, 6))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, idx, None, optimizer, repeats=1)
    check = remat.verify(model, idx, make_plan(prof, strategy="full"), None, optimizer, repeats=1)
    assert check.ok and check.grads_identical and check.grad_max_abs_diff == 0.0


def test_complex_differences_count_their_imaginary_parts():
    """``.double()`` dropped the imaginary part: gradients 9 apart in it compared as equal, and a
    NaN there went unreported."""
    from remat.verify import _max_abs_diff, _nonfinite

    a = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat)
    b = torch.tensor([1 + 5j, 2 - 7j], dtype=torch.cfloat)
    assert _max_abs_diff([a], [b]) == 9.0 and _max_abs_diff([a], [a.clone()]) == 0.0
    nan = torch.tensor([1 + float("nan") * 1j], dtype=torch.cfloat)
    assert _max_abs_diff([nan], [nan]) == float("inf")
    assert _nonfinite("planned", "gradient", [nan], ["w"]) == ["planned run: gradient w holds 1 NaN and 0 Inf of 1 values"]


def test_a_full_backward_hook_on_a_block_leaves_the_op_counts_as_planned():
    """A full backward hook makes the block's call wrap its inputs in views; a replay runs the
    block's forward alone and makes none. The views were counted as part of the forward a
    replay repeats: op counts reported off (14 views replayed, 15 expected) on a correct plan."""
    built = build("gpt", **TINY["gpt"])
    calls = []
    built.model.blocks[1].register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(1))
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    check = remat.verify(built.model, built.batch, make_plan(prof, strategy="full"), built.loss_fn, built.optimizer,
                         repeats=1)
    assert check.ok and check.grads_identical and check.recompute_counts_match
    assert calls  # the hook ran


class _DeepSupervision(torch.nn.Module):
    """Deep supervision written the usual way: forward hooks keep each block's output on the
    model, the loss reads them all."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                                              torch.nn.Linear(16, 8)) for _ in range(4))
        self.feats: list[torch.Tensor] = []
        for block in self.blocks:
            block.register_forward_hook(lambda module, args, output: self.feats.append(output))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.feats = []
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean() + 0.01 * sum(f.square().mean() for f in self.feats)


def test_features_a_hook_keeps_on_the_model_neither_pile_up_nor_stop_verify():
    """remat's probes called the blocks with their hooks: 119 outputs, each with its graph, were
    left on the model after the profile. And `verify`'s copy of the model failed on them (a
    tensor of a graph cannot be deep-copied; torch's error speaks of weight norm). Probes run a
    block's forward alone, as a replay does; the copy takes such tensors detached."""
    torch.manual_seed(0)
    model, x = _DeepSupervision(), torch.randn(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, None, optimizer, repeats=1)
    assert len(model.feats) <= len(model.blocks)
    check = remat.verify(model, x, make_plan(prof, strategy="full"), None, optimizer, repeats=1)
    assert check.ok and check.grads_identical
    assert 0 <= check.predicted_peak_bytes - check.measured_peak_bytes <= 0.005 * check.measured_peak_bytes


def test_a_nested_plan_whose_forward_is_its_peak_is_predicted_exactly():
    """Two nested children in one top-level segment replay cheaply, so the segment's forward,
    which holds every block's output for the model's calls, is the step's peak: it was not priced
    (+4.8 % here; a 64-block MLP's least-peak plan measured 2.3x its prediction)."""
    from remat.plan.types import Segment

    def r(a: int, b: int, *children: Segment) -> Segment:
        return Segment(start=a, stop=b, strategy="recompute", children=children)

    torch.manual_seed(0)
    built = build("mlp", depth=8, width=32, batch_size=256)
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    nested = make_plan(prof, strategy="none")
    nested = dataclasses.replace(nested, segments=(r(0, 6, r(0, 3, r(0, 2, r(0, 1))), r(3, 5, r(3, 4))), r(6, 7), r(7, 8)))
    from remat.plan.predict import predict

    nested = dataclasses.replace(nested, prediction=predict(prof, nested.segments))
    v = remat.verify(built.model, built.batch, nested, built.loss_fn, built.optimizer, repeats=1)
    assert v.grads_identical and v.measured_peak_bytes == v.predicted_peak_bytes


class _Supervised(nn.Module):
    """Deep supervision by forward hooks that close over the model (``self.feats.append``)."""

    def __init__(self, loss_inside: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.aux = nn.Linear(8, 3)
        self.feats: list[torch.Tensor] = []
        self.loss_inside = loss_inside
        for block in self.blocks:
            block.register_forward_hook(lambda module, args, output: self.feats.append(output))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.feats.clear()
        for block in self.blocks:
            x = block(x)
        if self.loss_inside:
            return sum(nn.functional.cross_entropy(self.aux(f), y) for f in self.feats) + x.pow(2).mean()
        return x


@pytest.mark.parametrize("loss_inside", [True, False], ids=["loss-in-forward", "loss_fn-reads-the-model"])
def test_verify_runs_hooks_and_a_loss_fn_that_close_over_the_model_on_its_copies(loss_inside):
    """``copy.deepcopy`` copies functions as themselves: the copies' hooks appended to the original's
    list (their own losses lacked the auxiliary terms, and verify passed a step that was not the
    one trained), and a loss_fn reading the model raised an autograd error inside verify."""
    torch.manual_seed(0)
    model = _Supervised(loss_inside)
    batch = {"x": torch.randn(4, 8), "y": torch.tensor([0, 1, 2, 0])}
    loss_fn = None if loss_inside else (
        lambda out, b: sum(nn.functional.cross_entropy(model.aux(f), b["y"]) for f in model.feats) + out.pow(2).mean())
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    before = list(model.feats)
    result = remat.verify(model, batch, remat.plan(prof, strategy="full"), loss_fn, repeats=1)
    assert result.ok and result.grads_identical
    assert len(model.feats) == len(before) and all(a is b for a, b in zip(model.feats, before))  # untouched


def test_rebound_points_closures_defaults_and_globals_at_the_copies():
    from remat.verify import _rebound

    original, other = nn.Linear(2, 2), nn.Linear(2, 2)
    twin = nn.Linear(2, 2)
    memo = {id(original): twin}
    captured = original

    def closure(x):
        return captured(x)

    def default(x, m=original, *, k=original):
        return m, k

    assert _rebound(closure, memo).__closure__[0].cell_contents is twin
    assert _rebound(default, memo)(0) == (twin, twin)
    untouched = lambda x: other(x)  # noqa: E731 - reads nothing memo copied
    assert _rebound(untouched, memo) is untouched
    assert _rebound(len, memo) is len  # not a Python function
    globals()["_GLOBAL_MODEL"] = original
    try:
        reads_global = eval("lambda: _GLOBAL_MODEL", globals())
        assert _rebound(reads_global, memo)() is twin and reads_global() is original  # only the copy sees it
    finally:
        del globals()["_GLOBAL_MODEL"]


class _LossHolder:
    """A trainer-like object whose loss reads ``self.model``."""

    def __init__(self, model):
        self.model = model
        self.as_lambda = lambda out, b: self.loss(out, b)

    def loss(self, out, b):
        return sum(nn.functional.cross_entropy(self.model.aux(f), b["y"]) for f in self.model.feats) + out.pow(2).mean()

    def __call__(self, out, b):
        return self.loss(out, b)


def _supervised_loss(model, out, b):
    return sum(nn.functional.cross_entropy(model.aux(f), b["y"]) for f in model.feats) + out.pow(2).mean()


@pytest.mark.parametrize("shape", ["partial", "partial-keyword", "callable-object", "lambda-in-a-class", "bound-method",
                                   "helper-closure"])
def test_verify_rebinds_every_shape_of_loss_fn_that_reads_the_model(shape):
    """Only plain functions were rebound: a partial, a callable object, a class's lambda or method,
    or a function calling a helper that closes over the model read the original in verify's runs
    (0 features each: both runs trained without the auxiliary losses, and verify passed)."""
    torch.manual_seed(0)
    model = _Supervised(loss_inside=False)
    batch = {"x": torch.randn(4, 8), "y": torch.tensor([0, 1, 2, 0])}
    holder = _LossHolder(model)

    def helper(out, b):
        return _supervised_loss(model, out, b)

    loss_fn = {"partial": functools.partial(_supervised_loss, model),
               "partial-keyword": functools.partial(lambda out, b, model: _supervised_loss(model, out, b), model=model),
               "callable-object": holder, "lambda-in-a-class": holder.as_lambda, "bound-method": holder.loss,
               "helper-closure": lambda out, b: helper(out, b)}[shape]
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    original_aux, ran = id(model.aux), []
    model.aux.register_forward_hook(lambda module, *_: ran.append(id(module) == original_aux))  # copied with the model
    result = remat.verify(model, batch, remat.plan(prof, strategy="full"), loss_fn, repeats=1)
    assert result.ok and result.grads_identical and result.peak_error_pct == 0.0
    assert ran and not any(ran)  # every auxiliary loss verify computed was a copy's
    assert all(p.grad is None for p in model.parameters())


def test_verify_runs_a_forward_patched_on_the_instance_on_its_copies():
    """An instance ``forward`` closing over the original's bound ``forward`` (TRL's fused-head patch):
    both of verify's runs ran the original model, "identical", 40 % off in peak, gradients left on it."""
    import types

    torch.manual_seed(0)
    model = _Supervised(loss_inside=True)
    batch = {"x": torch.randn(4, 8), "y": torch.tensor([0, 1, 2, 0])}
    original_forward = model.forward

    def forward(self, *args, **kwargs):
        return original_forward(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
    plan = remat.plan(remat.profile(model, batch, repeats=1), strategy="full")
    result = remat.verify(model, batch, plan, repeats=1)
    assert result.ok and result.grads_identical and result.peak_error_pct == 0.0
    linears = [(c.block, c.baseline_count, c.planned_count) for c in result.op_counts if c.op == "aten.addmm.default"]
    assert linears == [(f"blocks.{i}", 1, 2) for i in range(3)]  # the copies' blocks ran, and were recomputed
    assert all(p.grad is None for p in model.parameters())


def _deep_supervised():
    torch.manual_seed(0)
    model = _Supervised(loss_inside=False)
    return model, {"x": torch.randn(4, 8), "y": torch.tensor([0, 1, 2, 0])}


def _countdown_loss(n, out, b):
    """Recursive, reading the model (a global name of the test) at the bottom."""
    return _supervised_loss(_RECURSION_MODEL, out, b) if n == 0 else _countdown_loss(n - 1, out, b)


_RECURSION_MODEL = None


@pytest.mark.parametrize("shape", ["recursive-global", "recursive-closure", "optimizer-l2"])
def test_verify_rebinds_recursion_and_the_optimizer(shape):
    """A recursive loss read its original self below the first call (an autograd error about
    in-place changes); an L2 term over the optimizer's parameters read the original's (peak 20 %
    off, gradients left on the caller's model)."""
    model, batch = _deep_supervised()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    global _RECURSION_MODEL
    _RECURSION_MODEL = model

    def countdown(n, out, b):
        return _supervised_loss(model, out, b) if n == 0 else countdown(n - 1, out, b)

    loss_fn = {"recursive-global": lambda out, b: _countdown_loss(2, out, b),
               "recursive-closure": lambda out, b: countdown(2, out, b),
               "optimizer-l2": lambda out, b: _supervised_loss(model, out, b) + 1e-2 * sum(
                   p.pow(2).sum() for p in opt.param_groups[0]["params"])}[shape]
    prof = remat.profile(model, batch, loss_fn, opt, repeats=1)
    result = remat.verify(model, batch, remat.plan(prof, strategy="full"), loss_fn, opt, repeats=1)
    assert result.ok and result.grads_identical and result.peak_error_pct == 0.0
    assert all(p.grad is None for p in model.parameters())
    _RECURSION_MODEL = None


def test_verify_names_a_loss_that_reaches_the_model_through_what_cannot_be_copied():
    """An object holding the model beside a lock cannot be copied: its loss ran the original, and
    verify ended in an autograd error about in-place changes naming neither."""
    import threading

    model, batch = _deep_supervised()
    holder = _LossHolder(model)
    holder.lock = threading.Lock()
    prof = remat.profile(model, batch, holder, repeats=1)
    with pytest.raises(ValueError, match=r"^remat.verify steps copies of the model, but the original model's module "
                                         r"'aux' ran while it did: the loss_fn or a hook reaches the model through"):
        remat.verify(model, batch, remat.plan(prof, strategy="full"), holder, repeats=1)
    assert not model._forward_pre_hooks and not model.aux._forward_pre_hooks  # its guard is taken off
    model.blocks[0].register_forward_hook(_LockedHook())
    with pytest.raises(ValueError, match=r"^remat.verify runs both steps on copies of the model \(copy.deepcopy\), and "
                                         r"_Supervised cannot be copied: TypeError: cannot pickle '_thread.lock'"):
        remat.verify(model, batch, remat.plan(prof, strategy="full"), holder, repeats=1)


class _LockedHook:
    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def __call__(self, module, args, output):
        return None


COLLECTED: list[torch.Tensor] = []
"""Activations a user's forward hooks collect for an auxiliary loss (a module-level list)."""


def _collect(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    COLLECTED.append(output)


def _loss_with_activations(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    extra = sum(a.pow(2).mean() for a in COLLECTED)
    COLLECTED.clear()
    return output.pow(2).mean() + 1e-3 * extra


def test_a_loss_reading_what_user_hooks_collect_is_left_nothing_stale():
    """The profile ran a forward stopped after the last block it probes, before the loss: the
    hooks' activations stayed in the user's list, and the next loss (verify's, or the user's first
    step) read them through a graph long gone ("modified by an inplace operation"). With forward
    hooks and a loss_fn that forward runs whole."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)))
    for layer in model:
        layer.register_forward_hook(_collect)
    batch = (torch.randn(8, 16),)
    optimizer = torch.optim.AdamW(model.parameters())
    COLLECTED.clear()
    prof = remat.profile(model, batch, _loss_with_activations, optimizer, repeats=1)
    assert COLLECTED == []
    check = remat.verify(model, batch, make_plan(prof, strategy="full"), _loss_with_activations, optimizer, repeats=1)
    assert check.grads_identical and check.recompute_counts_match and COLLECTED == []


class _MasksLogits(torch.nn.Module):
    """Three residual units, then class logits with -inf at padded text positions, as Grounding
    DINO returns them; the loss reads the finite ones."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.cls = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, text_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        logits = self.cls(x).masked_fill(~text_mask, float("-inf"))
        finite = torch.where(text_mask, logits, torch.zeros_like(logits))
        return {"loss": finite.sigmoid().pow(2).mean(), "logits": logits}


def test_infinities_an_output_holds_by_design_in_both_runs_pass():
    """Grounding DINO and MM-Grounding DINO failed verify on every plan ("NaN or Inf" in output
    #1), with the loss and every gradient bit-identical: -inf is what the model puts in its
    padded logits. The same infinities in the same places pass; any other difference does not."""
    from remat.verify import _max_abs_diff

    torch.manual_seed(0)
    model, mask = _MasksLogits(), torch.ones(2, 16, 8, dtype=torch.bool)
    mask[..., 6:] = False
    batch = dict(x=torch.randn(2, 16, 32), text_mask=mask)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = remat.profile(model, batch, None, optimizer, repeats=1)
    check = remat.verify(model, batch, make_plan(prof, strategy="full"), None, optimizer, repeats=1)
    assert check.ok and check.grads_identical and check.nonfinite == () and check.output_max_abs_diff == 0.0
    inf = float("inf")
    a = torch.tensor([1.0, -inf, 2.0])
    assert _max_abs_diff([a], [torch.tensor([1.5, -inf, 2.0])], infinities=True) == 0.5
    assert _max_abs_diff([a], [torch.tensor([1.0, inf, 2.0])], infinities=True) == inf  # another sign
    assert _max_abs_diff([a], [torch.tensor([1.0, 3.0, -inf])], infinities=True) == inf  # another place
    assert _max_abs_diff([a], [a.clone()]) == inf  # gradients and the loss: never
    nan = torch.tensor([float("nan"), -inf])
    assert _max_abs_diff([nan], [nan.clone()], infinities=True) == inf


def test_a_gradient_zero_but_for_rounding_is_measured_against_the_steps_largest():
    """A chunked head's plan is verified within a relative tolerance per tensor. An attention key's
    bias has a gradient that is zero but for rounding (softmax does not change when a row's scores
    move alike): BERT's, 5.6e-12 against the step's largest 0.53, came out 57 % apart when the
    summation order changed (two CPU threads), and verify said the plan failed. Below sqrt(eps) of
    the largest gradient a tensor is measured against that floor; above it, against itself."""
    from remat.verify import max_rel_diff

    big, key_bias = torch.tensor([0.53, -0.2]), torch.tensor([5.57e-12, -3e-12])
    noisy = key_bias + torch.tensor([3.18e-12, 1e-12])
    assert max_rel_diff([noisy], [key_bias]) == pytest.approx(3.18e-12 / 5.57e-12)  # alone: its own scale
    floor = 0.53 * torch.finfo(torch.float32).eps ** 0.5
    assert max_rel_diff([big, noisy], [big, key_bias]) == pytest.approx(float(torch.tensor(3.18e-12)) / floor, rel=1e-6)
    assert max_rel_diff([big, noisy], [big, key_bias]) < 1e-7
    small = torch.tensor([1e-5, 2e-5])  # a small gradient 10 % wrong: 1.1 %, a thousand times a tolerance
    assert max_rel_diff([big, small * 1.1], [big, small]) == pytest.approx(float(small[1] * 0.1) / floor, rel=1e-5)
    assert max_rel_diff([big, small * 1.1], [big, small]) > 0.01
    large = torch.tensor([0.01, -0.02])  # above the floor: against itself
    assert max_rel_diff([big, large * 1.001], [big, large]) == pytest.approx(0.001, rel=1e-4)
    assert max_rel_diff([big, None], [big, key_bias]) == float("inf")


def test_a_chunked_head_on_bert_verifies_with_several_threads():
    """The model the test above is about, end to end: BERT's masked LM with a chunked head under
    `remat.verify`, with two intra-op threads (CPU's default here), as a user runs it."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "head"))
    from test_masked_lm_head import _built

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, batch = _built("bert")
        prof = remat.profile(model, batch, None, torch.optim.AdamW(model.parameters()), repeats=1, head_chunks=(7,))
        result = remat.verify(model, batch, make_plan(prof, strategy="none", head="chunked:7"), None,
                              torch.optim.AdamW(model.parameters()), repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert result.ok and result.relative_tolerance == 1e-5 and result.grad_max_rel_diff < 1e-5
