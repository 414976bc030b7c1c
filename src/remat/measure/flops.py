"""Forward FLOPs of one aten op call.

The formulas are those of ``torch.utils.flop_counter`` (the table behind
``FlopCounterMode``: 2 FLOPs per multiply-add for mm, addmm, bmm, convolution and the fused
attention kernels it knows). CPU attention kernels it does not list get the same formula as
its other attention kernels: ``2*B*H*L*S*E`` for ``Q @ K^T`` plus ``2*B*H*L*S*Ev`` for
``P @ V`` (no discount for a causal mask, as in ``torch.utils.flop_counter.sdpa_flop_count``).
``torch._grouped_mm`` (the experts of mixture-of-experts layers), which it does not list
either, counts 2 FLOPs per multiply-add of each group. Every other op counts 0: pointwise ops, norms and softmax are memory-bound and are not
counted by FlopCounterMode either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry


def attention_flops(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """FLOPs of ``softmax(Q K^T) V`` for (..., L, E) queries and (..., S, E) keys / (..., S, Ev) values."""
    batch_heads = query.shape[:-2].numel()
    length, head_dim = query.shape[-2], query.shape[-1]
    source = key.shape[-2]
    return 2 * batch_heads * length * source * head_dim + 2 * batch_heads * length * source * value.shape[-1]


def _cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> int:
    return attention_flops(query, key, value)


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *_: Any, out_val: torch.Tensor, **__: Any) -> int:
    """``torch._grouped_mm`` (mixture-of-experts layers): 2 FLOPs per multiply-add of each group.
    2-D x 3-D (tokens grouped by expert) and 3-D x 3-D: every output element sums over the
    inner dimension; 2-D x 2-D (groups along the inner dimension, as for expert weight
    gradients): every input row meets every output column once."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


_EXTRA: dict[Any, Any] = {}
if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_attention
if hasattr(torch.ops.aten, "_grouped_mm"):
    _EXTRA[torch.ops.aten._grouped_mm] = _grouped_mm


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Forward FLOPs of ``func(*args, **kwargs)`` that returned ``out`` (0 when not a FLOP op)."""
    packet = getattr(func, "_overloadpacket", func)
    if packet in _EXTRA:
        return int(_EXTRA[packet](*args, **kwargs, out_val=out))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _cpu_attention_shapes(query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    batch_heads = 1
    for n in query[:-2]:
        batch_heads *= n
    return 2 * batch_heads * query[-2] * key[-2] * (query[-1] + value[-1])


def _cpu_attention_backward_shapes(grad_out: Any, query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    return 2 * _cpu_attention_shapes(query, key, value)


def _grouped_mm_shapes(mat_a: Any, mat_b: Any, *_: Any, out_shape: Any, **__: Any) -> int:
    """`_grouped_mm` from shapes."""
    if len(mat_a) == 2 and len(mat_b) == 2:
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    elements = 1
    for n in out_shape:
        elements *= n
    return 2 * elements * mat_a[-1]


def step_flop_counter() -> FlopCounterMode:
    """``torch.utils.flop_counter.FlopCounterMode`` counting a training step as `remat.estimate`
    prices it: with the CPU attention kernel its table lacks, forward as `op_flops` counts it and
    backward twice that (the model-FLOPs convention; torch counts a fused GPU kernel's backward as
    2.5 forwards, for the scores it replays). Every other op, backward ones included, by torch's own
    table, which counts the products a backward runs: the input's gradient only where the input
    needs one, the weight's only where the weight is trained."""
    mapping: dict[Any, Any] = {}
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_attention_shapes
        mapping[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_attention_backward_shapes
    if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
        mapping[torch.ops.aten._grouped_mm] = _grouped_mm_shapes
    return FlopCounterMode(display=False, custom_mapping=mapping)
