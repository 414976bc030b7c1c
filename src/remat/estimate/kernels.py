"""What a GPU runs where the meta device (like the CPU) would run something else.

`GpuKernels` runs scaled dot-product attention as FlashAttention and dropout with 1-byte masks,
as a GPU does; `no_packed_sequence_check` lets a Hugging Face model trace on the meta device
without a key/value cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class GpuKernels(TorchFunctionMode):
    """Run two functions as the fused kernels a GPU runs, where the meta device (like the CPU)
    would decompose them into ops that save more:

    - ``F.scaled_dot_product_attention`` without an explicit mask: FlashAttention
      (``aten._scaled_dot_product_flash_attention``, whose meta kernel gives the real saved
      tensors: the output and a float32 log-sum-exp per query, no seq x seq scores).
      Grouped-query attention repeats K and V to all heads first (transformers' ``repeat_kv``).
      Values narrower than the queries (DeepSeek's multi-head latent attention) run as the
      memory-efficient kernel, which takes them as they are (FlashAttention needs equal widths).
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
    if value.size(-1) != query.size(-1):
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        return efficient(query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


@contextlib.contextmanager
def no_packed_sequence_check() -> Iterator[None]:
    """Without a key/value cache (``use_cache=False``, how models train), transformers asks
    whether the position ids pack several sequences per row
    (``masking_utils.find_packed_sequence_indices``) by reading their values, which a meta
    tensor has not. The traced batch is one sequence per row, numbered 0..s-1, for which that
    function answers None: this gives that answer without reading values."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


__all__ = ["GpuKernels", "no_packed_sequence_check"]
