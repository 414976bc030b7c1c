"""Trace one training step of a model on the meta device: no memory, no download, no data.

The model is built on the meta device with ``trace_layers`` layers (2 by default: the second
layer sees a layer's output as input, like every later layer) and `remat.profile` traces it at
micro-batch 1, 2 and 3, each on first use (a configuration whose model state alone does not
fit never needs 2 and 3): saved bytes per block and per op, block inputs, FLOPs. The same
code measures a real model on the CPU, so the estimate counts what a real run counts (with
`GpuKernels`, what a GPU's fused attention and dropout kernels save instead of the CPU's).
`remat.estimate.scale` then multiplies the layers and extrapolates the micro-batch.

A ``file.py:build`` model is built under ``torch.device("meta")`` as its function writes it
(all its layers) and traced once at the batch it returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from remat.estimate.sources import ModelSource, build_hf_on_meta, hf_batch, hf_config, num_layers
from remat.measure.blocks import find_blocks
from remat.measure.types import Profile
from remat.memory.optimizer_state import optimizer_name_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Shape = tuple[int, ...]

TRACED_MICRO_BATCHES = (1, 2, 3)
"""1 exactly; 2 and 3 for the line through every larger micro-batch (`remat.estimate.scale`)."""


@dataclass(kw_only=True, frozen=True)
class Traced:
    """What estimate knows about a model after tracing it."""

    label: str
    """Human name of the model."""
    tracer: Callable[[int], Profile] = field(repr=False, compare=False)
    """Traces one step at a micro-batch (1, 2 or 3); a file model ignores it (its own batch)."""
    num_layers: int
    """Layers of the full model (the traced blocks are copied to this count)."""
    fixed_shapes: tuple[Shape, ...]
    """Shapes of the parameters outside the blocks (each shared parameter once)."""
    block_shapes: tuple[Shape, ...]
    """Shapes of one block's parameters."""
    fixed_buffer_bytes: int
    """Buffers outside the blocks."""
    block_buffer_bytes: int
    """Buffers of one block."""
    block_name_format: str
    """How the full model names its blocks, e.g. ``"model.layers.{}"``."""
    unit_shapes: tuple[Shape, ...]
    """Shapes of the largest ZeRO-3/FSDP unit, all-gathered while it runs: one unit per layer
    plus the root unit holding everything outside the layers (embeddings, head), the larger."""
    whole: bool = False
    """True when the profile already covers every layer (a file model): nothing is copied."""
    optimizer_name: str | None = None
    """The table name of the optimizer the model came with (a file model's), else None."""
    _profiles: dict[int, Profile] = field(default_factory=dict, repr=False, compare=False)

    def profile(self, micro_batch: int) -> Profile:
        """The traced profile at micro-batch 1, 2 or 3, traced on first use (a file model: its batch)."""
        key = 1 if self.whole else micro_batch
        if key not in TRACED_MICRO_BATCHES:
            raise ValueError(f"traced micro-batches are {TRACED_MICRO_BATCHES}, got {micro_batch}.")
        if key not in self._profiles:
            self._profiles[key] = self.tracer(key)
        return self._profiles[key]

    @property
    def scalable(self) -> bool:
        """True when the micro-batch can be changed (traced at micro-batch 1, 2 and 3 on demand)."""
        return not self.whole

    @property
    def param_count(self) -> int:
        """Parameters of the full model."""
        return _count(self.fixed_shapes) + self.num_layers * _count(self.block_shapes)

    def param_shapes(self) -> list[Shape]:
        """Shapes of every parameter of the full model."""
        return list(self.fixed_shapes) + list(self.block_shapes) * self.num_layers


def _count(shapes: Sequence[Shape]) -> int:
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for ``bf16``, ``fp16`` or ``fp32``."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}.")
    return DTYPES[name]


def _unique_params(module: nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in module.parameters():
        seen.setdefault(id(p), p)
    return list(seen.values())


def _split_shapes(model: nn.Module, blocks: list[nn.Module]) -> tuple[tuple[Shape, ...], tuple[Shape, ...]]:
    """Shapes outside every block, and shapes of the last block."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    fixed = tuple(tuple(p.shape) for p in _unique_params(model) if id(p) not in in_blocks)
    return fixed, tuple(tuple(p.shape) for p in _unique_params(blocks[-1]))


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


class GpuKernels(TorchFunctionMode):
    """Run two functions as the fused kernels a GPU runs, where the meta device (like the CPU)
    would decompose them into ops that save more:

    - ``F.scaled_dot_product_attention`` without an explicit mask: FlashAttention
      (``aten._scaled_dot_product_flash_attention``, whose meta kernel gives the real saved
      tensors: the output and a float32 log-sum-exp per query, no seq x seq scores).
      Grouped-query attention repeats K and V to all heads first (transformers' ``repeat_kv``).
      Calls with a mask keep PyTorch's own path.
    - ``F.dropout`` in training: ``aten.native_dropout``, whose mask is 1-byte bool (the CPU
      path saves a mask in the activation dtype: 2 or 4 bytes per element).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _flash(*args, **kwargs)
        if func is F.dropout:
            return _native_dropout(*args, **kwargs)
        return func(*args, **kwargs)


def _native_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0 or inplace:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    groups = query.size(-3) // key.size(-3)
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


def trace_profile(model: nn.Module, batch: Any, loss_fn: Any = None, *, gpu_kernels: bool = False) -> Profile:
    """`remat.profile` of one training step (no optimizer, one repeat: times are not used);
    with ``gpu_kernels``, SDPA and dropout run as a GPU's fused kernels (`GpuKernels`)."""
    from remat.measure.profile import profile

    mode = GpuKernels() if gpu_kernels else contextlib.nullcontext()
    with mode:
        return profile(model, batch, loss_fn=loss_fn, optimizer=None, warmup=0, repeats=1)


def _describe(label: str, model: nn.Module, tracer: Callable[[int], Profile], layers: int) -> Traced:
    blocks = find_blocks(model)
    last_name, last = blocks[-1]
    fixed, block = _split_shapes(model, [m for _, m in blocks])
    prefix = last_name.rsplit(".", 1)[0] + "." if "." in last_name else ""
    return Traced(
        label=label, tracer=tracer, num_layers=layers, fixed_shapes=fixed, block_shapes=block,
        fixed_buffer_bytes=_buffer_bytes(model) - len(blocks) * _buffer_bytes(last),
        block_buffer_bytes=_buffer_bytes(last), block_name_format=prefix + "{}",
        unit_shapes=max((block, fixed), key=_count),
    )


def _describe_whole(label: str, model: nn.Module, profile: Profile, optimizer: Any) -> Traced:
    blocks = find_blocks(model)
    units = [tuple(tuple(p.shape) for p in _unique_params(m)) for _, m in blocks]
    return Traced(
        label=label, tracer=lambda _: profile, num_layers=len(blocks),
        fixed_shapes=tuple(tuple(p.shape) for p in _unique_params(model)), block_shapes=(),
        fixed_buffer_bytes=_buffer_bytes(model), block_buffer_bytes=0, block_name_format="{}",
        unit_shapes=max(units, key=_count) if units else (), whole=True,
        optimizer_name=optimizer_name_of(optimizer) if optimizer is not None else None,
    )


def _cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """Floating-point batch tensors in ``dtype`` (token ids and masks unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_batch(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_batch(v, dtype) for v in batch)
    return batch


def trace_source(
    source: ModelSource, *, seq_len: int, dtype: str = "bf16", trace_layers: int = 2, gpu_kernels: bool = True
) -> Traced:
    """Build ``source`` on the meta device and trace it (micro-batch 1, 2 and 3 where it can vary).

    ``gpu_kernels``: SDPA and dropout run as a GPU's fused kernels (`GpuKernels`); False traces
    what the CPU runs (the same bytes a CPU profile measures)."""
    torch_dtype = dtype_of(dtype)
    if source.file is not None:
        return _trace_file(source, torch_dtype, gpu_kernels)
    if source.builtin is not None:
        return _trace_builtin(source, seq_len=seq_len, dtype=torch_dtype, layers=trace_layers, fused=gpu_kernels)
    return _trace_hf(source, seq_len=seq_len, dtype=torch_dtype, layers=trace_layers, fused=gpu_kernels)


def _trace_hf(source: ModelSource, *, seq_len: int, dtype: torch.dtype, layers: int, fused: bool) -> Traced:
    config = hf_config(source)
    full = num_layers(config)
    model = build_hf_on_meta(config, layers=min(layers, full), dtype=dtype)

    def tracer(micro_batch: int) -> Profile:
        return trace_profile(model, hf_batch(config, micro_batch=micro_batch, seq_len=seq_len), gpu_kernels=fused)

    return _describe(source.label, model, tracer, full)


def _trace_builtin(source: ModelSource, *, seq_len: int, dtype: torch.dtype, layers: int, fused: bool) -> Traced:
    from remat.models import SIZE_OPTIONS, build, model_sizes

    known = model_sizes(source.builtin)
    layer_key = next((k for k in SIZE_OPTIONS["layers"] if k in known), None)
    if layer_key is None or "batch_size" not in known:
        raise ValueError(f"built-in model {source.builtin!r} has no layer count or batch size to vary; "
                         "estimate it from a file.py:build instead.")
    sizes = dict(source.sizes)
    full = int(sizes.pop(layer_key, known[layer_key]))
    if "seq_len" in known:
        sizes["seq_len"] = seq_len

    def make(micro_batch: int) -> Any:
        with torch.device("meta"):
            built = build(source.builtin, optimizer="none", batch_size=micro_batch, **{layer_key: min(layers, full)}, **sizes)
        built.model.to(dtype)
        return built

    def tracer(micro_batch: int) -> Profile:
        built = make(micro_batch)
        return trace_profile(built.model, _cast_batch(built.batch, dtype), built.loss_fn, gpu_kernels=fused)

    return _describe(source.builtin, make(1).model, tracer, full)


def _trace_file(source: ModelSource, dtype: torch.dtype, fused: bool) -> Traced:
    from remat.models import load_target

    with torch.device("meta"):
        built = load_target(source.file)
    built.model.to(dtype)
    profile = trace_profile(built.model, _cast_batch(built.batch, dtype), built.loss_fn, gpu_kernels=fused)
    return _describe_whole(source.file, built.model, profile, built.optimizer)
