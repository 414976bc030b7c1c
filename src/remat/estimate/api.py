"""`remat.estimate`: will this training step fit, on which device, with which strategy?

The arithmetic, for each device and strategy (per data-parallel rank):

    total = allocated peak + allowance
    allocated peak = plan's predicted peak (`remat.plan.predict`) on a profile whose model
                     state is the rank's share (`remat.memory.model_state`) and whose layers
                     and micro-batch come from a meta-device trace (`remat.estimate.trace`,
                     `remat.estimate.scale`)
    step time = grad_accumulation_steps x (forward + backward + recomputation FLOPs)
                / (MFU x peak FLOP/s) + optimizer step at memory bandwidth

Kernels: the trace runs SDPA as FlashAttention and dropout with 1-byte masks, as on a GPU
(``gpu_kernels=False`` traces the CPU's kernels instead). The optimal search may offload a
layer's saved tensors to host memory over the device's host link (none of the transfer
assumed hidden behind compute). ZeRO/FSDP communication time is not modelled (no
interconnect in the device table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate.devices import resolve_devices
from remat.estimate.pricing import Pricing
from remat.estimate.results import DeviceEstimate
from remat.estimate.scale import forward_flops
from remat.estimate.sources import ModelSource
from remat.estimate.strategies import STRATEGY_NAMES
from remat.estimate.trace import trace_source
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
    """Sequences per rank per micro-step (a file model: its own batch)."""
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
    """0 (plain data parallel), 1, 2 or 3 (FSDP)."""
    grad_accumulation_steps: int
    """Micro-steps per optimizer step."""
    mfu: float
    """Share of peak FLOP/s assumed for step times."""
    allowance: Allowance
    """Memory set aside beyond tensors (context, workspaces, fragmentation)."""
    model_state: ModelState
    """Unsharded model state of the whole model."""
    layer_saved_bytes: int
    """Saved bytes of one layer at this micro-batch."""
    layer_input_bytes: int
    """Input bytes of one layer (what full recomputation holds per layer)."""
    fixed_saved_bytes: int
    """Saved bytes outside the layers (embeddings, head, loss)."""
    train_flops: int
    """Forward + backward FLOPs of one micro-batch on one rank (no recomputation)."""
    devices: tuple[DeviceEstimate, ...]
    """One entry per device asked, in order."""


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
) -> Estimate:
    """Estimate memory and step time of one training step per device and strategy, without a GPU.

    ``source``: a `ModelSource`, a built-in model name (``"gpt"``) or ``"file.py:build"``.
    ``optimizer``: a name of the optimizer-state table; None: the optimizer a ``file.py:build``
    returns (its class decides the layout), else ``adamw``.
    ``gpu_kernels``: SDPA and dropout run as a GPU's fused kernels (FlashAttention, 1-byte
    dropout masks); False traces what the CPU runs. Explicit attention is traced as written. ``master_weights``: fp32 master copy in 16-bit training.
    ``foreach_optimizer``: count the temporaries of PyTorch's foreach Adam step (default: a
    fused step, which has none).
    """
    source = _as_source(source)
    _check_args(micro_batch, seq_len, mfu, grad_accumulation_steps, strategies)
    check_sharding(world_size, zero_stage)
    if optimizer is not None:
        optimizer_layout(optimizer)
    specs = resolve_devices(devices, devices_file)
    traced = trace_source(source, seq_len=seq_len, dtype=dtype, gpu_kernels=gpu_kernels)
    optimizer = optimizer or traced.optimizer_name or "adamw"
    setup = Pricing(traced=traced, micro_batch=micro_batch, optimizer=optimizer,
                   precision=precision_name(dtype, master_weights), world_size=world_size,
                   zero_stage=zero_stage, accumulation=grad_accumulation_steps, mfu=mfu,
                   allowance=allowance or Allowance(), strategies=tuple(strategies),
                   foreach_optimizer=foreach_optimizer)
    base = setup.profile_at(micro_batch)
    return Estimate(
        model=traced.label, param_count=traced.param_count, num_layers=traced.num_layers,
        micro_batch=micro_batch, seq_len=seq_len,
        dtype=dtype, precision=setup.precision, optimizer=optimizer, world_size=world_size,
        zero_stage=zero_stage, grad_accumulation_steps=grad_accumulation_steps, mfu=mfu,
        allowance=setup.allowance, model_state=setup.unsharded_state,
        layer_saved_bytes=base.blocks[-1].saved_bytes, layer_input_bytes=base.blocks[-1].input_bytes,
        fixed_saved_bytes=base.fixed_saved_bytes, train_flops=3 * forward_flops(base),
        devices=tuple(setup.on_device(spec) for spec in specs),
    )


def _as_source(source: ModelSource | str) -> ModelSource:
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, str):
        is_file = source.endswith(".py") or ".py:" in source
        return ModelSource(file=source) if is_file else ModelSource(builtin=source)
    raise TypeError(f"source must be a ModelSource or a model name, got {type(source).__name__}.")


def _check_args(micro_batch: int, seq_len: int, mfu: float, accumulation: int, strategies: Sequence[str]) -> None:
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("grad_accumulation_steps", accumulation)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}; 0.4 means 40% of the device's peak FLOP/s.")
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown or not strategies:
        raise ValueError(f"unknown strategies {unknown or '(none given)'}; allowed: {', '.join(STRATEGY_NAMES)}.")
