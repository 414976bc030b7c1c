"""`remat.estimate`: will this training step fit, on which device, with which strategy?

Per GPU, for each device and strategy (`remat.estimate.pricing`):

    total = allocated peak + allowance
    allocated peak = model state of the GPU's pipeline stage (`remat.estimate.sharding`: tensor,
                     pipeline and expert parallelism as Megatron-LM shards weights, ZeRO over
                     the data-parallel ranks) + the stage's activations at its peak
                     (`remat.estimate.stage`: the traced layers divided by the layout,
                     `remat.estimate.layers`, times the micro-batches in flight)
    step time = m x (forward + backward + replayed FLOPs) / (MFU x peak FLOP/s)
                + communication (`remat.estimate.comms`) + pipeline bubble
                + optimizer step at memory bandwidth

Kernels: the trace runs SDPA as FlashAttention and dropout with 1-byte masks, as on a GPU
(``gpu_kernels=False`` traces the CPU's kernels instead). Explicit attention is traced as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate.devices import resolve_devices
from remat.estimate.head import check_head
from remat.estimate.parallel import Parallelism
from remat.estimate.pricing import Pricing
from remat.estimate.results import DeviceEstimate, HeadEstimate
from remat.estimate.sharding import StateRecipe, check_layers, gpu_state
from remat.estimate.sources import ModelSource, as_source
from remat.estimate.strategies import STRATEGY_NAMES
from remat.estimate.trace import Traced, trace_source
from remat.memory.allowance import Allowance
from remat.memory.model_state import ModelState, check_sharding
from remat.memory.optimizer_state import optimizer_layout

__all__ = ["Estimate", "estimate", "precision_name"]


@dataclass(kw_only=True, frozen=True)
class Estimate:
    """The answer of `estimate`: the model, the setup and one entry per device."""

    model: str
    """The model's label (built-in name, ``hf:<family>``, config path or ``file.py:build``)."""
    param_count: int
    """Parameters of the whole model (a shared parameter once)."""
    num_layers: int
    """Layers (blocks) of the whole model."""
    micro_batch: int
    """Sequences per micro-batch (a file model: its own batch)."""
    seq_len: int
    """Tokens per sequence."""
    dtype: str
    """Weights and activations: ``bf16``, ``fp16`` or ``fp32``."""
    precision: str
    """``mixed`` (16-bit weights, fp32 master + optimizer state), ``bf16`` (pure) or ``fp32``."""
    optimizer: str
    """Name in the optimizer-state table."""
    world_size: int
    """Data-parallel ranks."""
    zero_stage: int
    """0 (plain data parallel), 1 (Megatron-LM's distributed optimizer), 2 or 3 (FSDP)."""
    fp32_grads: bool
    """Gradients kept in fp32 (Megatron-LM's ``main_grad``)."""
    parallelism: Parallelism
    """The parallel layout (its ``data`` is ``world_size``)."""
    gpus: int
    """GPUs of the job: data x tensor x pipeline x context."""
    grad_accumulation_steps: int
    """Micro-batches per optimizer step per pipeline."""
    mfu: float
    """Share of peak FLOP/s assumed for step times."""
    allowance: Allowance
    """Memory set aside beyond tensors (context, workspaces, fragmentation)."""
    model_state: ModelState
    """Unsharded model state of the whole model."""
    layer_saved_bytes: int
    """One layer's saved bytes per micro-batch on one GPU, without recomputation."""
    layer_input_bytes: int
    """One layer's input on one GPU: what full recomputation holds per layer."""
    fixed_saved_bytes: int
    """Saved bytes per micro-batch outside the layers on one GPU (embeddings and shared tensors
    before them, head and loss after)."""
    train_flops: int
    """Forward + backward FLOPs of one micro-batch on the GPU of the busiest stage (no recomputation)."""
    devices: tuple[DeviceEstimate, ...]
    """One entry per device asked, in order."""
    head: str = "keep"
    """The head strategy priced on the last stage (``chunked`` resolved to its chunk size)."""
    head_bytes: tuple[HeadEstimate, ...] = ()
    """Per GPU of the last stage, per micro-batch: ``keep``, ``recompute``, ``chunked`` at its default
    chunk and the strategy asked (empty: the model has no head part to price)."""
    head_note: str = ""
    """Why there is no head part to price (when ``head_bytes`` is empty)."""


def precision_name(dtype: str, master_weights: bool) -> str:
    """The model-state recipe for an activation dtype."""
    if dtype == "fp32":
        return "fp32"
    return "mixed" if master_weights else "bf16"


def estimate(
    source: ModelSource | str,
    *,
    devices: Sequence[str] = ("H100-80GB",),
    devices_file: str | None = None,
    micro_batch: int = 1,
    seq_len: int = 2048,
    dtype: str = "bf16",
    master_weights: bool = True,
    optimizer: str | None = None,
    world_size: int = 1,
    zero_stage: int = 0,
    grad_accumulation_steps: int = 1,
    mfu: float = 0.4,
    allowance: Allowance | None = None,
    strategies: Sequence[str] = STRATEGY_NAMES,
    gpu_kernels: bool = True,
    foreach_optimizer: bool = False,
    parallelism: Parallelism | None = None,
    fp32_grads: bool = False,
    network_bytes_per_s: float | None = None,
    head: str = "keep",
) -> Estimate:
    """Estimate memory and step time of one training step per GPU, device and strategy, without a GPU.

    ``source``: a `ModelSource`, a built-in model name (``"gpt"``) or ``"file.py:build"``.
    ``world_size``: data-parallel ranks; ``parallelism``: tensor, sequence, pipeline, context and
    expert parallelism (`remat.estimate.parallel.Parallelism`; its ``data`` defaults to ``world_size``).
    ``optimizer``: a name of the optimizer-state table; None: the optimizer a ``file.py:build``
    returns (its class decides the layout), else ``adamw``.
    ``gpu_kernels``: SDPA and dropout run as a GPU's fused kernels (FlashAttention, 1-byte
    dropout masks); False traces what the CPU runs. ``master_weights``: fp32 master copy in
    16-bit training. ``fp32_grads``: fp32 gradients (Megatron-LM's ``main_grad``).
    ``foreach_optimizer``: count the temporaries of PyTorch's foreach Adam step (default: a
    fused step, which has none). ``network_bytes_per_s``: between nodes, per GPU, one direction.
    ``head``: how the LM head and loss run on the last stage (`remat.estimate.head`): ``keep`` (what
    the model does), ``recompute``, ``chunked`` (chunks sized as `remat.estimate.head.default_chunk_tokens`)
    or ``chunked:<tokens>``.
    """
    source = as_source(source)
    _check_args(micro_batch, seq_len, mfu, grad_accumulation_steps, strategies)
    check_head(head)
    check_sharding(world_size, zero_stage)
    par = _layout(parallelism, world_size, grad_accumulation_steps)
    if optimizer is not None:
        optimizer_layout(optimizer)
    specs = resolve_devices(devices, devices_file)
    traced = trace_source(source, seq_len=seq_len, dtype=dtype, gpu_kernels=gpu_kernels)
    recipe = StateRecipe(optimizer=optimizer or traced.optimizer_name or "adamw",
                         precision=precision_name(dtype, master_weights), zero_stage=zero_stage, fp32_grads=fp32_grads)
    check_layout(traced, par, seq_len)
    setup = Pricing(traced=traced, micro_batch=micro_batch, micro_batches=grad_accumulation_steps, recipe=recipe,
                    parallelism=par, mfu=mfu, allowance=allowance or Allowance(), strategies=tuple(strategies),
                    network_bytes_per_s=network_bytes_per_s, foreach_optimizer=foreach_optimizer, head=head)
    setup.head_on_gpu(micro_batch)  # refuses a head strategy the model has no head for
    return _answer(setup, specs, seq_len=seq_len, dtype=dtype)


def _answer(setup: Pricing, specs: Sequence, *, seq_len: int, dtype: str) -> Estimate:
    traced, par, recipe = setup.traced, setup.parallelism, setup.recipe
    layer = setup.layer(setup.micro_batch, traced.layer_kinds[-1])
    stages = setup.stages(setup.micro_batch)
    whole = gpu_state(traced.params, Parallelism(), 0, dataclasses.replace(recipe, zero_stage=0))
    return Estimate(
        model=traced.label, param_count=traced.param_count, num_layers=traced.num_layers,
        micro_batch=setup.micro_batch, seq_len=traced.tokens or seq_len, dtype=dtype, precision=recipe.precision,
        optimizer=recipe.optimizer, world_size=par.data, zero_stage=recipe.zero_stage, fp32_grads=recipe.fp32_grads,
        parallelism=par, gpus=par.gpus, grad_accumulation_steps=setup.micro_batches, mfu=setup.mfu,
        allowance=setup.allowance, model_state=whole,
        layer_saved_bytes=int(layer.saved_bytes), layer_input_bytes=int(layer.input_bytes),
        fixed_saved_bytes=int(stages[0].pre_bytes + stages[-1].post_saved_bytes),
        train_flops=int(max(s.fwd_flops + s.bwd_flops for s in stages)),
        devices=tuple(setup.on_device(spec) for spec in specs),
        head=setup.head_name, head_bytes=setup.head_estimates(("keep", "recompute", "chunked", setup.head)),
        head_note=traced.head_note,
    )


def _layout(parallelism: Parallelism | None, world_size: int, micro_batches: int) -> Parallelism:
    par = parallelism or Parallelism()
    if par.data not in (1, world_size) and world_size != 1:
        raise ValueError(f"the data-parallel size is given twice: world_size={world_size} and "
                         f"parallelism.data={par.data}; pass it once.")
    par = dataclasses.replace(par, data=max(par.data, world_size))
    par.check_micro_batches(micro_batches)
    par.check_experts()
    return par


def check_layout(traced: Traced, par: Parallelism, seq_len: int) -> None:
    """Refuse a layout the model cannot be split by (with what would fit)."""
    check_layers(traced.num_layers, par)
    if traced.quantized and par.tensor > 1:
        raise ValueError(f"tensor-parallel size {par.tensor}: {traced.label} holds its base weights in "
                         f"{traced.quantized.upper()}, which the estimate prices whole on every GPU (as QLoRA runs: one "
                         "GPU, or data parallel); pass --tensor-parallel 1.")
    if traced.encoder_layers and (par.pipeline > 1 or par.context > 1):
        what = "pipeline" if par.pipeline > 1 else "context"
        size = par.pipeline if par.pipeline > 1 else par.context
        raise ValueError(f"{what}-parallel size {size}: {traced.label} is an encoder-decoder, whose {what} "
                         "parallelism the estimate does not price (every decoder layer reads the whole encoder "
                         f"output); pass --{what}-parallel 1 and split it with data, tensor and sequence parallelism "
                         "and ZeRO.")
    if traced.tokens and par.context > 1:
        raise ValueError(f"context-parallel size {par.context}: {traced.label} runs {traced.tokens} tokens a layer, set "
                         "by the model, not --seq; the estimate prices context parallelism over --seq. Pass "
                         "--context-parallel 1.")
    shape, t = traced.shape, par.tensor
    for name, value in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads)):
        if value and value % t:
            raise ValueError(f"tensor-parallel size {t} does not divide the model's {value} {name}; "
                             f"pick a --tensor-parallel that divides {value}.")
    if t > 1:
        widths = traced.classified(1).split_widths
        bad = sorted(name for name, width in widths.items() if width % t)
        if bad:
            raise ValueError(f"tensor-parallel size {t} does not divide the width {widths[bad[0]]} that "
                             f"{bad[0]} splits ({len(bad)} linear(s) in all); pick a --tensor-parallel dividing it.")
    if par.expert > 1 and (not shape.experts or shape.experts % par.expert):
        raise ValueError(f"expert-parallel size {par.expert} must divide the model's routed experts "
                         f"({shape.experts or 'none: not a MoE model'}); pick --expert-parallel dividing it.")
    if seq_len % par.context:
        raise ValueError(f"context-parallel size {par.context} does not divide the sequence of {seq_len} tokens; "
                         "pick --context-parallel dividing --seq.")


def _check_args(micro_batch: int, seq_len: int, mfu: float, accumulation: int, strategies: Sequence[str]) -> None:
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("grad_accumulation_steps", accumulation)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}; 0.4 means 40% of the device's peak FLOP/s.")
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown or not strategies:
        raise ValueError(f"unknown strategies {unknown or '(none given)'}; allowed: {', '.join(STRATEGY_NAMES)}.")
