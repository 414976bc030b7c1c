"""`remat.estimate` end to end on a small GPT and devices from a user file."""

from __future__ import annotations

import json
import math

import pytest

from dataclasses import replace

from remat.estimate import ModelSource, Parallelism, estimate
from remat.estimate.devices import DeviceSpec
from remat.estimate.layers import layer_cost
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE, Allowance
from remat.memory.model_state import model_state, shard_model_state
from remat.plan.predict import predict
from remat.plan.types import Segment

SIZES = dict(num_layers=4, d_model=32, num_heads=2, vocab_size=64)
SOURCE = ModelSource(builtin="gpt", sizes=SIZES)
SEQ = 16
BIG = DeviceSpec(name="Big", memory_bytes=2**32, peak_bf16_flops_per_s=1e12, memory_bytes_per_s=1e11)


@pytest.fixture(scope="module")
def traced():
    return trace_source(SOURCE, seq_len=SEQ)


def _devices_file(tmp_path, **memories: int):
    entries = [{"name": name, "memory_bytes": mem, "peak_bf16_flops_per_s": 1e12, "peak_fp32_flops_per_s": 1e12,
                "memory_bytes_per_s": 1e11} for name, mem in memories.items()]
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": entries}))
    return path


def _pricing(traced, *, zero: int = 0, micro_batches: int = 1, par: Parallelism | None = None) -> Pricing:
    recipe = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=zero)
    return Pricing(traced=traced, micro_batch=2, micro_batches=micro_batches, recipe=recipe,
                   parallelism=par or Parallelism(), mfu=0.5, allowance=NO_ALLOWANCE,
                   strategies=("none", "full", "selective", "optimal"))


def test_model_state_per_gpu_follows_zero(traced) -> None:
    params = traced.params
    parts = [params.pre, params.post, params.tied, *params.layers]
    shapes = [s for p in parts for s in (*p.tensor, *p.vocab, *p.whole, *p.expert)]
    assert len(params.layers) == 4 and params.count == sum(math.prod(s) for s in shapes)
    whole = model_state(shapes, optimizer="adamw", precision_name="mixed")
    sharded = _pricing(traced, zero=2, par=Parallelism(data=4)).state(0)
    assert replace(sharded, buffer_bytes=0) == shard_model_state(whole, world_size=4, zero_stage=2)
    assert sharded.gathered_bytes == 0
    assert _pricing(traced, zero=3, par=Parallelism(data=4)).state(0).gathered_bytes > 0


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_peaks_agree_with_the_planner(traced, micro_batches: int) -> None:
    """Keep and full recomputation on one GPU equal `remat.plan.predict` on the copied profile
    with the same model state. With one micro-batch per step gradients appear as the backward
    makes them, as the planner counts them (per-layer gradients in the profile); with two every
    gradient persists across micro-batches: the planner, given no per-layer gradients, counts all
    but those of the parts before the layers, which it allocates after the blocks' backward."""
    pricing = _pricing(traced, micro_batches=micro_batches)
    state = pricing.state(0)
    profile = traced.profile(2)
    layer = traced.params.layers[0]
    grads = 2 * sum(math.prod(s) for s in (*layer.tensor, *layer.whole)) if micro_batches == 1 else 0  # bf16
    copies = tuple(replace(profile.blocks[-1], index=i, name=f"blocks.{i}", grad_bytes=grads) for i in range(4))
    profile = replace(profile, blocks=copies,
                      param_bytes=state.param_bytes, grad_bytes=state.grad_bytes, buffer_bytes=state.buffer_bytes,
                      optimizer_state_bytes=state.master_bytes + state.optimizer_state_bytes)
    pre_grads = profile.fixed_pre_grad_bytes
    assert pre_grads == 2 * (64 * 32 + SEQ * 32)  # token and position embeddings, bf16
    for name, kind in (("none", "keep"), ("full", "recompute")):
        priced = pricing.price(BIG, name, 2, 2**32)
        planned = predict(profile, tuple(Segment(start=i, stop=i + 1, strategy=kind) for i in range(4)))
        assert priced.peaks[0].peak_bytes == planned.peak_bytes + (0 if micro_batches == 1 else pre_grads)


def test_step_time_by_hand(traced) -> None:
    """(forward + 2 x forward) FLOPs at 50% of 1 TFLOP/s and the optimizer step at memory bandwidth;
    full recomputation adds a forward per layer; selective adds the attention core: the larger of
    its FLOPs at that rate and writing its outputs at 1e11 B/s."""
    pricing = _pricing(traced)
    stage = pricing.stages(2)[0]
    state = pricing.state(0)
    optimizer_s = 2 * (state.param_bytes + state.grad_bytes + state.master_bytes + state.optimizer_state_bytes) / 1e11
    forward = sum(x.fwd_flops for x in stage.layers) + stage.post_flops
    rows = {name: pricing.price(BIG, name, 2, 2**32).time for name in ("none", "full", "selective")}
    assert rows["none"].total_s == pytest.approx(3 * forward / 0.5e12 + optimizer_s, rel=1e-12)
    replay = sum(x.fwd_flops for x in stage.layers) / 0.5e12
    assert rows["full"].total_s == pytest.approx(rows["none"].total_s + replay, rel=1e-12)
    core = sum(max(x.core_flops / 0.5e12, x.core_moved_bytes / 1e11) for x in stage.layers)
    assert rows["selective"].total_s == pytest.approx(rows["none"].total_s + core, rel=1e-12)
    assert rows["none"].comm_s == rows["none"].bubble_s == rows["none"].data_parallel_s == 0.0


def test_rows_per_device(traced) -> None:
    dev = _pricing(traced).on_device(BIG)
    none, full, selective, optimal = dev.strategies
    assert [r.plan_strategy for r in dev.strategies] == ["none", "full", "selective", "optimal: 4 none"]
    assert full.peak_bytes < selective.peak_bytes < none.peak_bytes
    assert optimal.peak_bytes == none.peak_bytes and optimal.recompute_flops == 0  # everything fits: keep all
    assert all(r.fits and r.allowance_bytes == 0 and r.diagnosis == "" for r in dev.strategies)
    layer = _pricing(traced).layer(2, 1)
    assert none.layer_retained_bytes == int(layer.saved_bytes) and full.layer_retained_bytes == int(layer.input_bytes)
    assert selective.layer_retained_bytes == int(layer_cost(layer, "selective").retained_bytes)


def test_largest_micro_batch_is_the_boundary(traced) -> None:
    pricing = _pricing(traced)
    target = max(p.peak_bytes for p in pricing.price(BIG, "none", 6, 2**32).peaks)
    device = DeviceSpec(name="Fit6", memory_bytes=int(target), peak_bf16_flops_per_s=1e12, memory_bytes_per_s=1e11)
    none, full = pricing.on_device(device).strategies[:2]
    assert none.max_micro_batch == 6
    assert full.max_micro_batch > 6


def test_micro_batches_repeat_the_step(traced) -> None:
    one = _pricing(traced).price(BIG, "none", 2, 2**32).time
    four = _pricing(traced, micro_batches=4).price(BIG, "none", 2, 2**32).time
    assert four.compute_s == pytest.approx(4 * one.compute_s) and four.optimizer_s == one.optimizer_s


def test_diagnoses(tmp_path) -> None:
    devices = _devices_file(tmp_path, Tiny=300_000, Small=1_100_000)
    result = estimate(SOURCE, devices=["Tiny", "Small"], devices_file=str(devices), seq_len=SEQ,
                      allowance=NO_ALLOWANCE, world_size=2, zero_stage=1, micro_batch=16)
    tiny, small = result.devices
    text = tiny.strategies[0].diagnosis
    assert not any(r.fits for r in tiny.strategies)
    assert "model state per rank is" in text and "with ZeRO-1 over 2 rank(s)" in text
    assert "Activation recomputation does not remove parameters, gradients or optimizer-state storage" in text
    assert "- ZeRO-3 / FSDP: from" in text and "optimizer offload to host at this setup" in text
    none = small.strategies[0]
    assert not none.fits and "the step peaks at" in none.diagnosis and "largest micro-batch that fits" in none.diagnosis
    assert small.strategies[1].fits  # full recomputation fits where keeping everything does not


def test_allowance_is_added_and_reported(tmp_path) -> None:
    devices = _devices_file(tmp_path, Big=2**32)
    allowance = Allowance(context_bytes=1000, workspace_bytes=24, fragmentation_fraction=0.5)
    result = estimate(SOURCE, devices=["Big"], devices_file=str(devices), seq_len=SEQ, allowance=allowance,
                      strategies=("none",))
    row = result.devices[0].strategies[0]
    assert row.allowance_bytes == 1024 + row.peak_bytes // 2
    assert row.total_bytes == row.peak_bytes + row.allowance_bytes
    assert result.devices[0].budget_bytes == allowance.max_allocated_bytes(2**32)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\], got 1.5"):
        estimate(SOURCE, mfu=1.5)
    with pytest.raises(ValueError, match=r"unknown strategies \['sqrt'\]; allowed: none, full, selective, optimal"):
        estimate(SOURCE, strategies=("sqrt",))
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got 5"):
        estimate(SOURCE, zero_stage=5)
    with pytest.raises(ValueError, match="micro_batch must be an integer >= 1, got 0"):
        estimate(SOURCE, micro_batch=0)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        estimate(SOURCE, optimizer="lamb")
    with pytest.raises(TypeError, match="source must be a ModelSource or a model name, got int"):
        estimate(3)


USER_FILE = '''
import torch
from torch import nn


def build():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
    batch = torch.ones(4, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, batch, lambda out, b: out.sum(), optimizer
'''


LOOPED_FILE = '''
import torch
from torch import nn


class Looped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(16, 16), nn.ReLU())

    def forward(self, x):
        for _ in range(3):
            x = self.layer(x)
        return x


def build():
    return Looped(), torch.ones(4, 16), lambda out, b: out.sum()
'''


def test_a_file_model_whose_layer_runs_at_every_depth_is_sent_to_the_profile(tmp_path) -> None:
    """The estimate finds layers from the structure alone; a layer run at several depths is
    planned call by call by the profile, which the message names."""
    path = tmp_path / "looped.py"
    path.write_text(LOOPED_FILE)
    with pytest.raises(ValueError, match=rf"^{path}:build: the estimate finds the layers it plans from the model's "
                                         r"structure alone, and no blocks found in Looped.*planned call by call on a "
                                         rf"device it runs on: `remat run --model {path}:build`"):
        estimate(f"{path}:build", devices=["Big"], devices_file=str(_devices_file(tmp_path, Big=2**32)))


def test_file_model_uses_its_own_optimizer_and_batch(tmp_path) -> None:
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE)
    devices = _devices_file(tmp_path, Big=2**32)
    result = estimate(f"{path}:build", devices=["Big"], devices_file=str(devices), dtype="fp32",
                      allowance=NO_ALLOWANCE)
    assert result.optimizer == "sgd-momentum" and result.precision == "fp32"
    assert result.param_count == 3 * (16 * 16 + 16) and result.num_layers == 3
    # fp32 weights + gradients + one momentum buffer, 4 bytes each
    assert result.model_state.total_bytes == 3 * 4 * result.param_count
    rows = result.devices[0].strategies
    assert all(r.fits and r.max_micro_batch is None for r in rows)  # the file's batch is fixed
    # a layer's ReLU saves its output (4x16 fp32); the next Linear saves that same storage, which
    # counts once, for the layer that saved it first; the first Linear saves the batch (input, not counted)
    assert result.layer_saved_bytes == 4 * 16 * 4


DIRECT_FILE = '''
import torch
from torch import nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x) if DIRECT else layer(x)
        return x


def build():
    return Stack(), torch.ones(4, 16), lambda out, b: out.sum()
'''


def test_a_file_model_that_calls_its_layers_forward_directly_is_estimated_as_one_that_calls_them(tmp_path) -> None:
    """SqueezeBERT's encoder calls ``layer.forward(...)``, past the hooks the estimate traces
    layers with: refused before as a step that "did not run its layers"; now the same figures as
    the model that calls its layers as modules."""
    devices = str(_devices_file(tmp_path, Big=2**32))
    results = []
    for direct in (True, False):
        path = tmp_path / f"stack_{direct}.py"
        path.write_text(f"DIRECT = {direct}\n" + DIRECT_FILE)
        results.append(estimate(f"{path}:build", devices=["Big"], devices_file=devices, dtype="fp32",
                                allowance=NO_ALLOWANCE))
    direct, called = results
    assert direct.num_layers == called.num_layers == 3
    # each layer's ReLU saves its 4x16 fp32 output (the next Linear saves the same storage)
    assert direct.layer_saved_bytes == called.layer_saved_bytes == 4 * 16 * 4
    assert [r.peak_bytes for r in direct.devices[0].strategies] == [r.peak_bytes for r in called.devices[0].strategies]


def test_optimizer_names_from_instances() -> None:
    import torch

    from remat.memory.optimizer_state import optimizer_name_of

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_name_of(torch.optim.SGD(params, lr=0.1)) == "sgd"
    assert optimizer_name_of(torch.optim.SGD(params, lr=0.1, momentum=0.5)) == "sgd-momentum"
    assert optimizer_name_of(torch.optim.AdamW(params)) == "adamw"
    assert optimizer_name_of(torch.optim.Adafactor(params)) == "adafactor"
    with pytest.raises(ValueError, match="optimizer RMSprop has no entry in the state table"):
        optimizer_name_of(torch.optim.RMSprop(params))


def test_a_builtins_step_sizes_are_the_estimates_own_arguments():
    """``batch_size`` in a built-in's sizes reached `remat.models.build` beside the estimate's own
    (a TypeError, "got multiple values for keyword argument"); ``seq_len`` was replaced without a
    word. Both are refused, naming the argument to pass."""
    from remat.estimate.sources import ModelSource

    with pytest.raises(ValueError, match=r"sizes \['batch_size', 'seq_len'\] of the built-in model 'gpt' are the "
                       r"estimate's own arguments; pass micro_batch=, seq_len= to remat.estimate instead"):
        ModelSource(builtin="gpt", sizes=dict(num_layers=2, seq_len=32, batch_size=2))
    with pytest.raises(ValueError, match=r"\['optimizer'\] .* pass optimizer= to remat.estimate"):
        ModelSource(builtin="mlp", sizes=dict(depth=2, optimizer="sgd"))
    assert ModelSource(builtin="gpt", sizes=dict(num_layers=2)).sizes == {"num_layers": 2}


def test_an_fp32_step_is_priced_at_the_devices_fp32_rate(tmp_path):
    """float32 matmuls run at the FP32 rate (an H200's 67 TFLOP/s against 989 in BF16): priced at
    the BF16 rate, an fp32 GPT's step was 8.0 ms against 82.9 measured on an H200. A device with
    no FP32 rate is refused for fp32 and priced as before for bf16."""
    from remat.estimate.sources import ModelSource

    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": [
        {"name": "Fast32", "memory_bytes": 2**36, "peak_bf16_flops_per_s": 1e12, "peak_fp32_flops_per_s": 1e12},
        {"name": "Slow32", "memory_bytes": 2**36, "peak_bf16_flops_per_s": 1e12, "peak_fp32_flops_per_s": 1e11},
        {"name": "No32", "memory_bytes": 2**36, "peak_bf16_flops_per_s": 1e12}]}))
    source = ModelSource(builtin="gpt", sizes=dict(num_layers=2, d_model=64, num_heads=2, vocab_size=64))
    run = lambda devices, dtype: estimate(source, devices=devices, devices_file=str(path), micro_batch=2,  # noqa: E731
                                          seq_len=32, dtype=dtype, strategies=("none",))
    fast, slow = (d.strategies[0].time.compute_s for d in run(["Fast32", "Slow32"], "fp32").devices)
    assert slow == pytest.approx(10 * fast)
    with pytest.raises(ValueError, match=r"device 'No32' has no peak_fp32_flops_per_s: an fp32 step runs its matmuls "
                                         r"far below the BF16 rate .* add the FP32 rate to a devices file"):
        run(["No32"], "fp32")
    bf16 = run(["Fast32", "No32"], "bf16").devices
    assert bf16[0].strategies[0].time.compute_s == bf16[1].strategies[0].time.compute_s
