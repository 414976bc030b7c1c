"""What a GPU runs where the meta device (like the CPU) would run something else.

`GpuKernels` runs scaled dot-product attention as FlashAttention and dropout with 1-byte masks,
as a GPU does; `CpuKernels` runs attention as the CPU's fused kernel; `no_packed_sequence_check` lets a Hugging Face model trace on the meta device
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
      Grouped-query attention (``enable_gqa``, transformers' call without a mask) keeps K and V
      as given, not repeated per query head (`_GroupedFlash`). Values narrower than the queries
      (DeepSeek's multi-head latent attention) run as the memory-efficient kernel, which takes
      them as they are (FlashAttention needs equal widths); so do calls with a mask (a sliding
      window, Falcon's), the mask as an additive bias of its own shape: PyTorch's path on the
      meta device would save the seq x seq scores of every head, which no GPU kernel keeps.
    - ``F.dropout`` in training: ``aten.native_dropout``, whose mask is 1-byte bool (the CPU
      path saves a mask in the activation dtype: 2 or 4 bytes per element).

    And, while active, a Mamba-2 mixer's fused training function as ``mamba_ssm``'s kernel
    (`remat.estimate.ssm.Mamba2Kernels`).
    """

    def __enter__(self) -> GpuKernels:
        from remat.estimate.ssm import Mamba2Kernels

        self._mamba2 = Mamba2Kernels().__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._mamba2.__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _flash(*args, **kwargs)
        if func is F.dropout:
            return _native_dropout(*args, **kwargs)
        return func(*args, **kwargs)


class CpuKernels(TorchFunctionMode):
    """Run ``F.scaled_dot_product_attention`` as PyTorch's CPU runs it, where the meta device
    would take the math path (every head's seq x seq scores saved): the CPU's fused flash kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``: grouped-query K and V as given, a mask
    kept as the float bias it is made into), but with attention dropout, which sends the CPU down
    the math path too. What `remat.profile` measures on a CPU (``--cpu-kernels``)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _cpu_flash(*args, **kwargs)
        return func(*args, **kwargs)


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    if dropout_p > 0.0 or value.size(-1) != query.size(-1) or (query.size(-3) != key.size(-3) and not enable_gqa):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    mask = None if attn_mask is None else _bias(attn_mask, query.dtype)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]


def _native_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0 or inplace:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor:
    groups = query.size(-3) // key.size(-3)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    if attn_mask is not None:  # FlashAttention takes no mask: the memory-efficient kernel, with the mask as a bias
        if groups > 1:  # it takes no groups either (transformers repeats K and V itself when it passes a mask)
            key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
        return efficient(query, key, value, _bias(attn_mask, query.dtype), True, dropout_p, is_causal, scale=scale)[0]
    if value.size(-1) != query.size(-1):
        if groups > 1:
            key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
        return efficient(query, key, value, None, True, dropout_p, is_causal, scale=scale)[0]
    if groups > 1:
        if not enable_gqa:  # as transformers' repeat_kv leaves them: K and V repeated before the call
            key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
        else:
            return _GroupedFlash.apply(query, key, value, dropout_p, is_causal, scale)
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    return flash(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias PyTorch makes of it for a fused kernel (True: attend):
    a tensor of the mask's shape in the queries' dtype, made in each call and saved by it."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))


class _GroupedFlash(torch.autograd.Function):
    """FlashAttention on grouped-query K and V (``enable_gqa``, as transformers calls SDPA without
    a mask): the kernel reads each K and V head for its group of query heads, so autograd keeps
    them as given, not repeated per query head; the backward makes the repeated K and V
    gradients and sums them per group (FlashAttention-2 does the same)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                is_causal: bool, scale: float | None) -> torch.Tensor:
        groups = query.size(-3) // key.size(-3)
        repeated = [t.repeat_interleave(groups, dim=-3) for t in (key, value)]
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = flash(query, *repeated, dropout_p, is_causal, False,
                                                                     scale=scale)
        del repeated
        ctx.save_for_backward(query, key, value, out, lse, seed, offset)
        ctx.cum, ctx.max, ctx.flags = (cum_q, cum_k), (max_q, max_k), (groups, dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse, seed, offset = ctx.saved_tensors
        groups, dropout_p, is_causal, scale = ctx.flags
        repeated = [t.repeat_interleave(groups, dim=-3) for t in (key, value)]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, query, *repeated, out, lse, *ctx.cum, *ctx.max, dropout_p, is_causal, seed, offset, scale=scale)
        per_group = [t.unflatten(-3, (key.size(-3), groups)).sum(-3) for t in (dk, dv)]
        return dq, *per_group, None, None, None


FLASH_ATTENTION = "remat_kernel"
"""The name `register_flash_attention` gives transformers for `flash_attention_forward`."""


def register_flash_attention() -> str:
    """Register `flash_attention_forward` with transformers' attention functions (once) and return
    its name, for ``config._attn_implementation``: how the estimate runs a model that transformers
    offers FlashAttention but no SDPA (Gemma 2's softcapping, GPT-OSS's sinks)."""
    from transformers import AttentionInterface

    if FLASH_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(FLASH_ATTENTION, flash_attention_forward)
    return FLASH_ATTENTION


def flash_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention as transformers' ``flash_attention_2`` runs it in training: causal by the kernel's
    flag, no mask made (none is: a name outside transformers' mask functions gets none), grouped
    K and V as given. A logit softcap, attention sinks and a sliding window are the kernel's
    arguments (FlashAttention 2 and 3 take them), which change none of what it saves (the output
    and a float32 log-sum-exp per query); on the meta device, under `GpuKernels`, this is the SDPA
    call that becomes that kernel."""
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def no_packed_sequence_check() -> Iterator[None]:
    """Without a key/value cache (``use_cache=False``, how models train), transformers asks
    whether the position ids pack several sequences per row
    (``masking_utils.find_packed_sequence_indices``) by reading their values, which a meta
    tensor has not. The traced batch is one sequence per row, numbered 0..s-1, for which that
    function answers None: this gives that answer without reading values, and answers True to
    ``fast_all`` of a meta padding mask (no token of the traced batch is padding). A model called
    without an attention mask (BERT's older copies: Megatron-BERT, RemBERT, RoFormer, XLM) looks
    for padding in its ids to warn of it (``warn_if_padding_and_no_attention_mask``), which reads
    values too: on meta ids it looks for none."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    pretrained = sys.modules["transformers.modeling_utils"].PreTrainedModel
    warn = pretrained.warn_if_padding_and_no_attention_mask

    def warn_unless_meta(self: Any, input_ids: Any, attention_mask: Any) -> None:
        if not getattr(input_ids, "is_meta", False):
            warn(self, input_ids, attention_mask)

    pretrained.warn_if_padding_and_no_attention_mask = warn_unless_meta
    # a boolean mask indexing on meta (wav2vec 2.0's SpecAugment writes a learned vector into the
    # masked frames) takes every element as selected: the indices it saves are counted at most
    import torch.fx.experimental._config as fx_config

    every = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    # an encoder that makes its own mask of ones (Megatron-BERT, RemBERT) asks whether the
    # bidirectional mask can be left out, as it can where no token is padding
    skip = getattr(masking, "_ignore_bidirectional_mask_sdpa", None)
    if skip is not None:
        masking._ignore_bidirectional_mask_sdpa = lambda padding_mask, *args, **kwargs: skip(
            None if getattr(padding_mask, "is_meta", False) else padding_mask, *args, **kwargs)
    all_set = getattr(masking, "fast_all", None)
    masking.find_packed_sequence_indices = lambda position_ids: None
    if all_set is not None:
        # a padding mask the model makes itself (BART's decoder: ones) asks whether every token is
        # real; the traced batch pads none, and a meta tensor has no values to answer
        masking.fast_all = lambda tensor: True if tensor.is_meta else all_set(tensor)
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original
        pretrained.warn_if_padding_and_no_attention_mask = warn
        fx_config.meta_nonzero_assume_all_nonzero = every
        if skip is not None:
            masking._ignore_bidirectional_mask_sdpa = skip
        if all_set is not None:
            masking.fast_all = all_set


_META_LIBRARY: list = []


def register_meta_ctc_kernels() -> None:
    """Give ``aten::_ctc_loss_backward`` a meta kernel where torch has none (2.13): the gradient of
    the log-probabilities, their shape and dtype, as the CPU and CUDA kernels return it; and
    ``aten::masked_select`` one (`_masked_select_all`). A speech encoder's CTC loss
    (`remat.estimate.sources.ctc_loss_fn`) then runs on the meta device, forward and backward.
    Registered once per process, only where the operator has no meta kernel."""
    name = "aten::_ctc_loss_backward"
    if _META_LIBRARY or torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
        return
    library = torch.library.Library("aten", "IMPL", "Meta")

    def grad_of_log_probs(grad: torch.Tensor, log_probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.empty_like(log_probs)

    library.impl("_ctc_loss_backward", grad_of_log_probs)
    library.impl("_ctc_loss_backward.Tensor", grad_of_log_probs)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_ctc_loss.Tensor", "Meta"):
        library.impl("_ctc_loss.Tensor", _ctc_loss_equal_targets)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::masked_select", "Meta"):
        library.impl("masked_select", _masked_select_all)
    _META_LIBRARY.append(library)  # a library unregisters its kernels when collected


def _ctc_loss_equal_targets(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
                            blank: int = 0, zero_infinity: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``_ctc_loss`` with lengths as tensors, on meta tensors: the loss per sequence and
    ``log_alpha`` (batch, frames, 2 x targets + 1), as the CPU and CUDA kernels return them, every
    sequence's targets taken as long as the others' (the traced batch's are; the lengths' values
    are not there to read)."""
    frames, batch = log_probs.shape[:2]
    per_sequence = targets.shape[1] if targets.dim() == 2 else targets.numel() // max(batch, 1)
    return log_probs.new_empty((batch,)), log_probs.new_empty((batch, frames, 2 * per_sequence + 1))


def _masked_select_all(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``masked_select`` on meta tensors where every element is taken as selected, as
    ``meta_nonzero_assume_all_nonzero`` takes them (set while the estimate traces,
    `no_packed_sequence_check`; a CTC loss selects its targets, every one real in the traced batch);
    unimplemented otherwise, as without this kernel."""
    import torch.fx.experimental._config as fx_config

    if not fx_config.meta_nonzero_assume_all_nonzero:
        raise NotImplementedError("aten::masked_select has no meta kernel: its size depends on the mask's values.")
    return tensor.new_empty((torch.broadcast_shapes(tensor.shape, mask.shape).numel(),))


__all__ = ["CpuKernels", "FLASH_ATTENTION", "GpuKernels", "flash_attention_forward", "no_packed_sequence_check",
           "register_flash_attention", "register_meta_ctc_kernels"]
